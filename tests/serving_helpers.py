"""What the `bitune-serve` tests share: the miniature base with a random Bitune adapter, clients, and two references
that do not go through the server's cache: a full prefill, and greedy decoding with the training forward alone."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from peft_bitune.serving.app import ChatCompletions
from peft_bitune.serving.engine import ChatEngine
from peft_bitune.serving.streaming import TextStream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "miniature", "base")
TEMPLATE_FILE = os.path.join(ROOT, "examples", "miniature", "chat_template.jinja")
NAME = "miniature-bitune"
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 300  # generous: on a loaded CI machine a request may wait behind all the others
STORIES = [
    "Story: Ana has 2 hats. Bo has 5 hats.\nAsk: How many hats do they have?",
    "Story: Leki packed a map, a coin and a vase into a bag.\nAsk: Is there a book in the bag?",
    "Story: Zafu packed a cup and a coin into a bag.\nAsk: How many things are in the bag?",
    "Story: Kuza packed a vase, a rope and a box into a bag.\nAsk: What went into the bag first?",
    "Story: Mio has 3 cups. Tey has 1 cup.\nAsk: Who has more cups?",
    "Story: Ro packed a hat and a map into a bag.\nAsk: What went into the bag last?",
    "Story: Nel has 4 coins. Pim has 4 coins.\nAsk: Do they have the same number of coins?",
    "Story: Oda packed a rope into a bag.\nAsk: Is there a rope in the bag?",
]
FOLLOW_UPS = ["Ask: Are you sure?", "Ask: Say it again."]


def load_model(adapter_dir: str):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), adapter_dir).eval()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def ask(client, messages: list[dict], max_tokens: int = MAX_TOKENS, **fields) -> tuple[str, int, int]:
    """(answer, prompt_tokens, cached_tokens) of one greedy request."""
    response = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=max_tokens, temperature=0, **fields
    )
    usage = response.usage
    return response.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def converse(client, user_turns: list[str], max_tokens: int = MAX_TOKENS, **fields) -> list[tuple[str, int, int]]:
    """`ask` per turn, each turn sending the whole conversation so far with the answers the server gave."""
    messages, results = [], []
    for turn in user_turns:
        messages.append(user(turn))
        results.append(ask(client, messages, max_tokens, **fields))
        messages.append(assistant(results[-1][0]))
    return results


def post_raw(url: str, body: bytes, path: str = "/v1/chat/completions", headers: dict | None = None):
    """(status, JSON answer, response headers) of a raw POST."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def get_json(url: str, path: str, headers: dict | None = None):
    request = urllib.request.Request(url + path, headers=headers or {})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


class FullPrefill:
    """The answers of a server that keeps nothing (every request a full prefill), computed in this thread: the
    reference the server's answers must equal whatever it kept."""

    def __init__(self, model, tokenizer, template: str) -> None:
        self.engine = ChatEngine(model, tokenizer, template, cache_budget_bytes=0)
        self.requests = ChatCompletions(self.engine, NAME)

    def result(self, messages: list[dict], max_tokens: int = MAX_TOKENS, **fields):
        body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
        return self.engine.run(self.requests.chat_request(body))

    def answer(self, messages: list[dict], max_tokens: int = MAX_TOKENS, **fields) -> str:
        return self.result(messages, max_tokens, **fields).content


def greedy_by_the_training_forward(model, prompt, max_tokens: int, eos_ids: set[int]) -> list[int]:
    """
    Greedy decoding with the training forward alone (no cache, no `generate`): at each step the conversation so far,
    every answer supervised (as training marks them: `prompt`'s answer segments, then the answer so far and a
    placeholder), and the argmax of the logits that predict the placeholder.
    """
    answer: list[int] = []
    while len(answer) < max_tokens and not (answer and answer[-1] in eos_ids):
        ids = prompt.token_ids + answer + [0]
        supervised = prompt.answer_mask() + [True] * (len(answer) + 1)
        labels = [token if is_answer else -100 for token, is_answer in zip(ids, supervised)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).logits
        answer.append(int(logits[0, -2].argmax()))
    return answer


def streamed_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """The pieces of text a `TextStream` hands out for `token_ids`, put one by one after a prompt (not streamed)."""
    pieces = []
    stream = TextStream(tokenizer, pieces.append)
    stream.put(torch.tensor([[1, 2, 3]]))  # the prompt: not streamed
    for token in token_ids:
        stream.put(torch.tensor([token]))
    stream.end()
    return pieces

"""What `bitune-serve`'s conversation cache saves: prefill tokens and time per turn of a 5-turn chat, with and without
reuse.

The same conversation (five user turns made of the embedded miniature data, see `user_turns`; answers of a fixed
length) goes through the real HTTP server with the `openai` client, streamed and greedy, in each round once to a server
that keeps conversation caches (each later turn reads only its new tokens, paper A.8 alternating) and once to one with
a zero cache budget (every turn a full prefill of the whole conversation, read turn by turn as the adapter was
trained); the two alternate, so that a noisy machine slows both alike, and each round is a new conversation for both.
Per turn it records the prompt tokens, the tokens actually read (`prompt_tokens - cached_tokens`), the time to the
first answer token (queue + prefill + first decoding step) and the whole turn's time; the medians over `--rounds`
rounds (after one warm-up round) are reported.

    python benchmarks/serving_reuse.py --json docs/serving_reuse.json        # miniature and small shapes, CPU
    python benchmarks/serving_reuse.py --model medium --device cuda           # a ~1B-parameter Llama shape

The adapters are random (answers are not meaningful) and EOS is disabled so that both servers generate the same number
of tokens per turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MINIATURE = os.path.join(ROOT, "examples", "miniature")
TURNS = 5
MINIATURE_VOCAB = 1024


def build_model(name: str, device: str, dtype: torch.dtype, tokenizer):
    """A Bitune model with random (non-zero) adapters over the miniature base or a random Llama shape."""
    from transformers import AutoModelForCausalLM

    from benchmarks.models import MODEL_SIZES

    torch.manual_seed(0)
    if name == "miniature":
        base = AutoModelForCausalLM.from_pretrained(os.path.join(MINIATURE, "base"), dtype=dtype)
    else:
        config = MODEL_SIZES[name].llama_config()
        config.vocab_size = MINIATURE_VOCAB  # the miniature tokenizer renders the chat: every id must decode
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return with_random_adapters(base, device, tokenizer)


def with_random_adapters(base, device: str, tokenizer):
    """`base` with random (non-zero) Bitune adapters, answering with printable tokens and never EOS (answers of a fixed
    length), in eval mode on `device`."""
    from peft import LoraConfig, get_peft_model

    import peft_bitune

    torch.manual_seed(0)
    inner = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, peft_bitune.BituneConfig(adapter_config=inner)).to(device).eval()
    model.generation_config.eos_token_id = None  # fixed-length answers: every server decodes the same tokens
    model.generation_config.pad_token_id = 0
    # Random weights pick any token; allow only those that decode to printable text on their own, so that every
    # answer token streams as text and its arrival can be timed.
    model.generation_config.suppress_tokens = [
        i for i in range(len(tokenizer)) if not _printable(tokenizer.decode([i]))
    ]
    return model


def miniature_chat():
    """The miniature's tokenizer and chat template (it has none of its own)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(MINIATURE, "base"))
    with open(os.path.join(MINIATURE, "chat_template.jinja"), encoding="utf-8") as file:
        return tokenizer, file.read()


def start_server(stack: contextlib.ExitStack, model, tokenizer, template: str | None, cache_budget_bytes: int,
                 limits=None):
    """A `bitune-serve` app over `model` on a thread of this process (until `stack` closes): its engine, and an
    `openai` client of it that serves the model under the name "bench"."""
    import openai

    from peft_bitune.serving import ChatEngine
    from peft_bitune.serving.app import build_app
    from peft_bitune.serving.server import serving_in_thread

    engine = ChatEngine(model, tokenizer, template, cache_budget_bytes=cache_budget_bytes, limits=limits)
    url = stack.enter_context(serving_in_thread(build_app(engine, "bench")))
    return engine, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _printable(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable()


def user_turns(long: bool) -> list[str]:
    """Short: a held-out story with its question, then four follow-up questions (the "Ask:" lines of the next held-out
    prompts), a chat that fits in the miniature's 256 positions. Long: each turn is six held-out prompts (about 330
    tokens), for models with 2048 positions, where the prefill rather than Python overhead sets the time."""
    with open(os.path.join(MINIATURE, "data", "test.jsonl"), encoding="utf-8") as file:
        prompts = [json.loads(line)["prompt"].removesuffix("Answer:").strip() for line in file]
    if long:
        return ["\n".join(prompts[6 * i : 6 * i + 6]) for i in range(TURNS)]
    asks = [line for prompt in prompts[1:] for line in prompt.splitlines() if line.startswith("Ask:")]
    return [prompts[0], *asks[: TURNS - 1]]


def run_conversation(client, name: str, turns: list[str], max_tokens: int) -> list[dict]:
    messages, rows = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        start = time.perf_counter()
        first_token, answer, usage = None, [], None
        for chunk in client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first_token = first_token or time.perf_counter()
                answer.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        end = time.perf_counter()
        messages.append({"role": "assistant", "content": "".join(answer)})
        cached = usage.prompt_tokens_details.cached_tokens
        rows.append({"prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                     "read_tokens": usage.prompt_tokens - cached, "completion_tokens": usage.completion_tokens,
                     "time_to_first_token_s": first_token - start, "turn_s": end - start})
    return rows


def measure(model_name: str, device: str, dtype: torch.dtype, rounds: int, max_tokens: int) -> dict:
    tokenizer, template = miniature_chat()
    model = build_model(model_name, device, dtype, tokenizer)
    turns = user_turns(long=model_name != "miniature")
    modes = {"reuse": 2**30, "full_prefill": 0}
    runs: dict[str, list] = {mode: [] for mode in modes}
    with contextlib.ExitStack() as stack:
        clients, engines = {}, {}
        for mode, budget in modes.items():  # two servers over the one model; requests never overlap
            engines[mode], clients[mode] = start_server(stack, model, tokenizer, template, budget)
        for round_index in range(rounds + 1):  # the modes alternate, so that a noisy machine slows both alike
            for mode, client in clients.items():
                engines[mode].store.clear()  # each round a new conversation (the same one would be a retry)
                rows = run_conversation(client, "bench", turns, max_tokens)
                if round_index > 0:  # round 0 warms up
                    runs[mode].append(rows)
    result = {
        mode: [
            {
                key: (statistics.median(run[i][key] for run in mode_runs) if key.endswith("_s")
                      else mode_runs[0][i][key])
                for key in mode_runs[0][i]
            }
            for i in range(TURNS)
        ]
        for mode, mode_runs in runs.items()
    }
    result["totals"] = {
        key: {mode: sum(run[key] for run in result[mode]) for mode in ("reuse", "full_prefill")}
        for key in ("read_tokens", "time_to_first_token_s")
    }
    return result


def table(name: str, result: dict) -> str:
    lines = [
        f"### {name}",
        "",
        "| turn | prompt tokens | read with reuse | read without | first token with reuse (ms) | "
        "without (ms) | turn with reuse (ms) | without (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, (reuse, full) in enumerate(zip(result["reuse"], result["full_prefill"]), start=1):
        lines.append(f"| {i} | {full['prompt_tokens']} | {reuse['read_tokens']} | {full['read_tokens']} | "
                     f"{reuse['time_to_first_token_s'] * 1e3:.1f} | {full['time_to_first_token_s'] * 1e3:.1f} | "
                     f"{reuse['turn_s'] * 1e3:.1f} | {full['turn_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", choices=["miniature", "tiny", "small", "medium"],
                        help="Repeat for several (default: miniature and small).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="Default: float32 on CPU, bfloat16 on CUDA.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="Answer length per turn (default: 4 on the miniature, whose 256 positions must hold all "
                             "five turns, else 16).")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="Write the results here.")
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        parser.error("--rounds and --max-tokens must be at least 1.")
    torch.set_num_threads(args.threads)
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    else:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    report = {
        "settings": {"turns": TURNS, "rounds": args.rounds, "device": args.device,
                     "dtype": str(dtype), "threads": args.threads},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__, "machine": platform.machine(),
                        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "models": {},
    }
    for name in args.model or ["miniature", "small"]:
        max_tokens = args.max_tokens or (4 if name == "miniature" else 16)
        report["models"][name] = {"max_tokens": max_tokens,
                                  **measure(name, args.device, dtype, args.rounds, max_tokens)}
        print(table(name, report["models"][name]), "\n", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return report


if __name__ == "__main__":
    main()

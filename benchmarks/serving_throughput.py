"""What batching buys `bitune-serve`: throughput and time to first token with N concurrent clients, batched against
`--max-batch-size 1`.

N clients (1, 2, 4, 8 by default) talk to the real HTTP server at once with the `openai` client, streamed and greedy;
each sends `--requests` single-turn requests one after another (held-out prompts of the embedded miniature data, of
different lengths; the same prompt for the same client and request in every arm). Two servers run over the one model:
one batching (`--max-batch-size`, default 8) and one answering one request at a time; they take turns, so that a noisy
machine slows both alike. Neither keeps conversations (a budget of 0), so that each arm reads every prompt in full.
The adapters are random and EOS is disabled, so every answer has `--max-tokens` tokens.

Per client count and arm it reports the generated tokens per second over the wall time of the whole run (all clients
together), and the time to first token (the first streamed text, from the request's start: queue + prefill + first
step), median and p90 over all requests; `throughput_ratio[N]` is batched over unbatched tokens per second, and
`identical` says whether every greedy answer of the batching server equals the unbatched server's.

    python benchmarks/serving_throughput.py --quick --json out.json    # the miniature, 1 2 4 8 clients, CPU
    python benchmarks/serving_throughput.py --model smollm2 --max-tokens 8 --clients 1 4 8
    python benchmarks/serving_throughput.py --model smollm2 --device cuda --clients 1 2 4 8 16 32

`--model smollm2` serves SmolLM2-135M-Instruct's real weights (examples/smollm2/load.py; needs its one-time
conversion) with its own tokenizer and the chat template the quickstart trains it with
(examples/smollm2/chatml_training.jinja: its ChatML with TRL's `{% generation %}` markers, the same text).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.serving_reuse import MINIATURE, build_model, miniature_chat, start_server, with_random_adapters  # noqa: E402

ARMS = ("batched", "unbatched")


def prompts(count: int) -> list[str]:
    """Held-out prompts of the miniature data (stories with a question), as many as asked for (repeated if needed)."""
    with open(os.path.join(MINIATURE, "data", "test.jsonl"), encoding="utf-8") as file:
        texts = [json.loads(line)["prompt"].removesuffix("Answer:").strip() for line in file]
    return [texts[i % len(texts)] for i in range(count)]


def load(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer, chat template) of the miniature (or a random Llama shape over its tokenizer) or of
    SmolLM2-135M-Instruct, with random adapters."""
    if name != "smollm2":
        tokenizer, template = miniature_chat()
        return build_model(name, device, dtype, tokenizer), tokenizer, template
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, os.path.join(ROOT, "examples", "smollm2"))
    from load import smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    # Its own template has no markers and is none TRL knows: an alternating adapter is not served with it.
    with open(os.path.join(ROOT, "examples", "smollm2", "chatml_training.jinja"), encoding="utf-8") as file:
        template = file.read()
    return with_random_adapters(base, device, tokenizer), tokenizer, template


def one_client(client, texts: list[str], max_tokens: int, start: threading.Barrier, rows: list) -> None:
    start.wait()
    for text in texts:
        began, first, answer, usage = time.perf_counter(), None, [], None
        for chunk in client.chat.completions.create(model="bench", messages=[{"role": "user", "content": text}],
                                                    max_tokens=max_tokens, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                answer.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        rows.append({"text": "".join(answer), "tokens": usage.completion_tokens, "ttft_s": first - began})


def run_arm(client, texts: list[list[str]], max_tokens: int) -> dict:
    """All clients at once (client i sends texts[i] in order); wall time, tokens and each request's row."""
    rows: list[list[dict]] = [[] for _ in texts]
    start = threading.Barrier(len(texts) + 1)
    threads = [threading.Thread(target=one_client, args=(client, own, max_tokens, start, rows[i]))
               for i, own in enumerate(texts)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    if any(len(own) != len(sent) for own, sent in zip(rows, texts)):
        raise RuntimeError("A client did not get all of its answers.")
    return {"wall_s": wall, "tokens": sum(row["tokens"] for own in rows for row in own), "rows": rows}


def summary(runs: list[dict]) -> dict:
    ttfts = sorted(row["ttft_s"] for run in runs for own in run["rows"] for row in own)
    return {
        "tokens_per_s": sum(run["tokens"] for run in runs) / sum(run["wall_s"] for run in runs),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": statistics.quantiles(ttfts, n=10, method="inclusive")[-1] if len(ttfts) > 1 else ttfts[0],
    }


def measure(model, tokenizer, template, clients: list[int], requests: int, max_tokens: int, rounds: int,
            max_batch_size: int) -> dict:
    from peft_bitune.serving.settings import BatchLimits

    result: dict = {"clients": clients, "by_clients": {}}
    identical = True
    with contextlib.ExitStack() as stack:
        servers = {arm: start_server(stack, model, tokenizer, template, 0, BatchLimits(max_batch_size=size))
                   for arm, size in (("batched", max_batch_size), ("unbatched", 1))}
        for count in clients:
            texts = prompts(count * requests)
            per_client = [texts[i * requests : (i + 1) * requests] for i in range(count)]
            runs: dict[str, list] = {arm: [] for arm in ARMS}
            for round_index in range(rounds + 1):  # the arms take turns; round 0 warms up
                for arm in ARMS:
                    run = run_arm(servers[arm][1], per_client, max_tokens)
                    if round_index > 0:
                        runs[arm].append(run)
            answers = {arm: [[row["text"] for row in own] for own in runs[arm][0]["rows"]] for arm in ARMS}
            identical &= answers["batched"] == answers["unbatched"]
            cell = {arm: summary(runs[arm]) for arm in ARMS}
            cell["throughput_ratio"] = cell["batched"]["tokens_per_s"] / cell["unbatched"]["tokens_per_s"]
            worker = servers["batched"][0].worker
            cell["batch_sizes"] = worker.batch_size_counts()
            worker.batch_sizes.clear()
            result["by_clients"][str(count)] = cell
            print(f"{count} clients: {cell['throughput_ratio']:.2f}x", flush=True)
    result["throughput_ratio"] = {n: cell["throughput_ratio"] for n, cell in result["by_clients"].items()}
    result["identical"] = identical
    return result


def table(result: dict) -> str:
    lines = ["| clients | tokens/s, batched | tokens/s, one at a time | ratio | first token median, batched (ms) | "
             "one at a time (ms) | first token p90, batched (ms) | one at a time (ms) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for count, cell in result["by_clients"].items():
        b, u = cell["batched"], cell["unbatched"]
        lines.append(f"| {count} | {b['tokens_per_s']:.0f} | {u['tokens_per_s']:.0f} | "
                     f"{cell['throughput_ratio']:.2f} | {b['ttft_median_s'] * 1e3:.0f} | "
                     f"{u['ttft_median_s'] * 1e3:.0f} | "
                     f"{b['ttft_p90_s'] * 1e3:.0f} | {u['ttft_p90_s'] * 1e3:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="miniature", choices=["miniature", "tiny", "small", "smollm2"],
                        help="the embedded miniature (default), a random Llama shape, or SmolLM2's real weights")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=None, help="requests per client (default 4, 2 with --quick)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3, 1 with --quick)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="the batching server's --max-batch-size")
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds (a few minutes on CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="Default: float32 on CPU, bfloat16 on CUDA.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="Write the results here.")
    args = parser.parse_args(argv)
    requests = args.requests or (2 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 3)
    if min(args.clients) < 1 or requests < 1 or rounds < 1 or args.max_tokens < 1 or args.max_batch_size < 1:
        parser.error("--clients, --requests, --rounds, --max-tokens and --max-batch-size must be at least 1.")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json!r}: its folder does not exist.")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model, tokenizer, template = load(args.model, args.device, dtype)
    report = measure(model, tokenizer, template, sorted(set(args.clients)), requests, args.max_tokens, rounds,
                     args.max_batch_size)
    report["settings"] = {"model": args.model, "requests_per_client": requests, "max_tokens": args.max_tokens,
                          "rounds": rounds, "max_batch_size": args.max_batch_size, "device": args.device,
                          "dtype": str(dtype), "threads": args.threads}
    report["environment"] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    }
    print(table(report), flush=True)
    print(f"identical: {report['identical']}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return report


if __name__ == "__main__":
    main()

"""
A batch whose rows name two adapters (`adapter_names`): one batch against the split it replaced, in one run.

Until issue 63, a mixed-adapter batch was split by adapter: each adapter's rows ran their own `generate`, and the
outputs were stitched back in row order. Now it is one batch: every pass routes each row to its adapter's weight set
through LoRA's per-row `adapter_names`. The split is timed here as a user would write it with the public API (for each
adapter: `set_adapter`, `generate` its rows; then the sequences put back in row order, padded to one width), which is
what the split did inside, and the one batch is `generate(..., adapter_names=...)`. Both decode every row to
`--new-tokens` (no EOS), greedily, and must give the same sequences. A third workload, the whole batch with one
adapter (no `adapter_names`), is what a batch of that shape costs without per-row adapters: on a CPU a larger batch
is not always cheaper per row than two smaller ones, and this separates that from the cost of routing rows. Rounds are
interleaved, on the CPU-time clock (`measure.py`); each ratio is one batch over the other (below 1: one batch is
faster).

    python benchmarks/mixed_adapters.py --json docs/results/mixed_adapters.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from peft import get_peft_model  # noqa: E402

from measure import Clock, Ratio, RoundPolicy, interleaved_rounds  # noqa: E402
from models import MODEL_SIZES, lora_config, prompt_batch, random_base  # noqa: E402
from peft_bitune import BituneConfig  # noqa: E402

CELLS = [(4, 32), (8, 64), (16, 128)]  # (batch, prompt length)
ADAPTERS = ("default", "second")


def split_generate(model, batch: dict[str, torch.Tensor], names: list[str], settings: dict) -> torch.Tensor:
    """The split, by the public API: each adapter's rows generated apart, the sequences put back in row order."""
    parts = []
    for name in dict.fromkeys(names):
        rows = torch.tensor([i for i, n in enumerate(names) if n == name])
        model.set_adapter(name)
        parts.append((rows, model.generate(**{k: v[rows] for k, v in batch.items()}, **settings)))
    model.set_adapter(ADAPTERS[0])
    width = max(sequences.shape[1] for _, sequences in parts)
    merged = parts[0][1].new_full((len(names), width), settings["pad_token_id"])
    for rows, sequences in parts:
        merged[rows, : sequences.shape[1]] = sequences
    return merged


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist.")
    if args.new_tokens < 1 or args.rounds < 1:
        parser.error("--new-tokens and --rounds must be at least 1.")
    torch.set_num_threads(args.threads)
    device, size = torch.device("cpu"), MODEL_SIZES[args.model]
    base = random_base(size, device, torch.float32, "sdpa")
    model = get_peft_model(base, BituneConfig(adapter_config=lora_config()))
    torch.manual_seed(1)
    config = lora_config()
    config.init_lora_weights = False  # the second adapter differs from the first
    model.add_adapter(ADAPTERS[1], BituneConfig(adapter_config=config))
    model.set_adapter(ADAPTERS[0])
    model.eval()
    settings = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    clock, policy = Clock("cpu", device), RoundPolicy(min_rounds=args.rounds, max_rounds=args.rounds)

    cells = []
    print(f"{'batch':>5s} {'P':>4s} {'split ms':>9s} {'one adapter ms':>15s} {'one batch ms':>13s} {'/split':>7s} "
          f"{'/one adapter':>13s}")
    for batch_size, prompt_length in CELLS:
        batch = prompt_batch(batch_size, prompt_length, size.vocab_size, device)
        names = [ADAPTERS[i % 2] for i in range(batch_size)]
        one = model.generate(**batch, **settings, adapter_names=names)
        if not torch.equal(one, split_generate(model, batch, names, settings)):
            raise SystemExit("The one batch and the split gave different sequences: the comparison would be void.")
        workloads = {
            "split": lambda: {"t": clock.timed(lambda: split_generate(model, batch, names, settings))},
            "single": lambda: {"t": clock.timed(lambda: model.generate(**batch, **settings))},
            "one": lambda: {"t": clock.timed(lambda: model.generate(**batch, **settings, adapter_names=names))},
        }
        rounds = interleaved_rounds(workloads, policy)
        split, single = (Ratio.from_rounds(rounds, "one/t", f"{other}/t") for other in ("split", "single"))
        cells.append(dict(batch_size=batch_size, prompt_length=prompt_length, new_tokens=args.new_tokens,
                          one_batch_over_split=split.as_dict(), one_batch_over_one_adapter=single.as_dict()))
        print(f"{batch_size:5d} {prompt_length:4d} {1e3 * split.denominator_s:9.1f} "
              f"{1e3 * single.denominator_s:15.1f} {1e3 * split.numerator_s:13.1f} {split.value:7.3f} "
              f"{single.value:13.3f}")
    report = {"model": args.model, "adapters": len(ADAPTERS), "cells": cells,
              "environment": {"python": platform.python_version(), "torch": torch.__version__,
                              "threads": args.threads, "clock": "cpu"}}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

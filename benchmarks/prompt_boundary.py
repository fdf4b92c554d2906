"""
What reading the prompt passes layer by layer costs and saves under activation checkpointing
(`peft_bitune/tuner/layer_inputs.py`). Measured.

A checkpointed training step runs the prompt passes' decoder layers without autograd, and the answer pass's layer l
recomputes both passes' keys and values of layer l (the layer up to its cache update, in the forward and again in the
answer layer's checkpointed recomputation) and differentiates the layer in its backward ("recompute"). The
alternative it replaced records the keys and values in checkpointed prompt passes ("record"), which holds them, and
then their gradient, for every layer until the prompt passes' backward starts. This script times a checkpointed
training step (forward and backward) with each, interleaved, on the same model and batch, and takes each one's peak:

    python benchmarks/prompt_boundary.py --json docs/results/prompt_boundary.json   # smollm2's shape, multi-head
    python benchmarks/prompt_boundary.py --key_value_heads 3 --json docs/results/prompt_boundary_grouped_query.json

The default shape is SmolLM2-135M's (`--model`) with as many key/value heads as query heads (9 of 64, as on multi-head
models such as Gemma-7B, Llama-2-7B and Phi-2); `--key_value_heads 3` is SmolLM2's own grouped-query shape.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from measure import Clock, Ratio, RoundPolicy, interleaved_rounds, peak_bytes_during  # noqa: E402
from models import MODEL_SIZES, build_pair, training_batch  # noqa: E402
from peft_bitune import compat  # noqa: E402

CELLS = [(8, 128, 32), (4, 256, 64)]  # (batch, prompt length, answer length)


def measure(name: str, key_value_heads: int, clock: Clock, policy: RoundPolicy) -> dict:
    """Per cell: the step time with the prompt passes read layer by layer over the step time with their keys/values
    recorded, and each one's peak bytes, on the model shape `name` with `key_value_heads`."""
    size = replace(MODEL_SIZES[name], num_key_value_heads=key_value_heads)
    model = build_pair(size, clock.device, torch.float32, "sdpa").bitune
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    tuner = model.base_model
    passes = type(tuner)._passes

    def boundary(recompute: bool) -> None:
        # The one decision the passes read, forced one way or the other (Bitune recomputes under checkpointing).
        tuner._passes = lambda: replace(passes(tuner), recompute_prompt=recompute)

    result = {"model": name, "key_value_heads": key_value_heads, "cells": []}
    for batch_size, prompt_length, answer_length in CELLS:
        batch = training_batch(batch_size, prompt_length, answer_length, size.vocab_size, clock.device)

        def step(recompute: bool) -> dict[str, float]:
            boundary(recompute)
            model.zero_grad(set_to_none=True)
            return {"t": clock.timed(lambda: model(**batch).loss.backward())}

        rounds = interleaved_rounds({"recompute": lambda: step(True), "record": lambda: step(False)}, policy)
        ratio = Ratio.from_rounds(rounds, "recompute/t", "record/t")
        peaks = {}
        for name, recompute in (("recompute", True), ("record", False)):
            boundary(recompute)
            peaks[name] = peak_bytes_during(lambda: model(**batch).loss.backward(), clock.device)
        cell = {"batch_size": batch_size, "prompt_length": prompt_length, "answer_length": answer_length,
                "time": ratio.as_dict(), "peak_bytes": peaks}
        result["cells"].append(cell)
        print(f"{key_value_heads:3d} kv heads  {batch_size:5d} {prompt_length:4d} {answer_length:4d}  "
              f"time recompute / record {ratio.value:6.3f}  peak MiB {peaks['recompute'] / 2**20:8.1f} recompute, "
              f"{peaks['record'] / 2**20:8.1f} record", flush=True)
    del tuner._passes
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="smollm2")
    parser.add_argument("--key_value_heads", type=int, help="default: as many as query heads (multi-head)")
    parser.add_argument("--rounds", type=int, help="rounds per cell (default: 5 to 11, within a time budget)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    heads = MODEL_SIZES[args.model].num_attention_heads
    key_value_heads = heads if args.key_value_heads is None else args.key_value_heads
    if key_value_heads < 1 or heads % key_value_heads:
        parser.error(f"--key_value_heads must divide the {heads} query heads of {args.model}, got {key_value_heads}.")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist.")
    torch.set_num_threads(1)
    clock = Clock("cpu", torch.device("cpu"))
    policy = RoundPolicy(min_rounds=args.rounds or 5, max_rounds=args.rounds or 11, budget_s=60.0)
    result = measure(args.model, key_value_heads, clock, policy)
    result["environment"] = {"torch": torch.__version__, "threads": 1, "clock": "cpu"}
    print("\ntime: a checkpointed training step with the prompt passes read layer by layer (recomputed in the answer "
          "pass) over one with their keys/values recorded (fastest of the interleaved rounds, CPU time).")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

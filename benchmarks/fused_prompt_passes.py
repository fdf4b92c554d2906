"""
Would one fused forward for both prompt passes pay? An upper bound on what it could save, measured.

Bitune runs its two prompt passes (bidirectional weights and mask, then causal weights and mask) as two forwards of B
rows. Fusing them means one forward of 2B rows with per-row adapters and a per-row mask. Its best case is one plain
pass of 2B rows (same adapter for every row, one mask kind): this script times that against two passes of B rows,
interleaved, for inference (generation prefill) and for training (forward and backward through the recorded
keys/values). A real fused path would cost more than that best case: mixed-batch adapters add gathers and scatters
per layer, and a per-row mask is a 4D mask (no `is_causal` fast path in SDPA, no flash attention, and sliding-window
models would need one such mask per layer type).

    python benchmarks/fused_prompt_passes.py                 # CPU, `small` model, one thread
    python benchmarks/fused_prompt_passes.py --device cuda   # `medium` model in bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from measure import Clock, Ratio, RoundPolicy, interleaved_rounds  # noqa: E402
from models import MODEL_SIZES, build_pair, prompt_batch  # noqa: E402
from peft_bitune.tuner.caches import pass_cache  # noqa: E402
from peft_bitune.utils.base_model import num_layers  # noqa: E402

CELLS = [(1, 128), (8, 32), (8, 128), (16, 128)]  # (batch, prompt length)


def prompt_pass(bitune, inputs: dict[str, torch.Tensor], train: bool) -> None:
    """One causal prompt pass that records its keys/values (and, in training, backpropagates through them)."""
    passes = bitune._passes()
    cache = pass_cache(num_layers(bitune.model), record=True, stop_after_last_record=passes.stop_early)
    with torch.set_grad_enabled(train):
        passes.prompt_pass("causal", cache, **inputs)
        if train:
            sum(layer.recorded_keys.float().sum() + layer.recorded_values.float().sum()
                for layer in cache.layers).backward()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for, but this torch build sees no CUDA device.")
    torch.set_num_threads(args.threads)
    size = MODEL_SIZES[args.model or ("small" if device.type == "cpu" else "medium")]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    bitune = build_pair(size, device, dtype, "sdpa").bitune.base_model
    clock = Clock("cpu" if device.type == "cpu" else "wall", device)
    policy = RoundPolicy(min_rounds=args.rounds, max_rounds=args.rounds)

    print(f"{'mode':9s} {'batch':>5s} {'P':>4s} {'2 passes of B ms':>17s} {'1 pass of 2B ms':>16s} {'ratio':>6s}")
    for train in (False, True):
        bitune.train(train)
        for batch_size, prompt_length in CELLS:
            single = prompt_batch(batch_size, prompt_length, size.vocab_size, device)
            double = prompt_batch(2 * batch_size, prompt_length, size.vocab_size, device)
            workloads = {
                "two": lambda: {"t": clock.timed(lambda: (prompt_pass(bitune, single, train),
                                                          prompt_pass(bitune, single, train)))},
                "fused": lambda: {"t": clock.timed(lambda: prompt_pass(bitune, double, train))},
            }
            ratio = Ratio.from_rounds(interleaved_rounds(workloads, policy), "fused/t", "two/t")
            print(f"{'training' if train else 'inference':9s} {batch_size:5d} {prompt_length:4d} "
                  f"{1e3 * ratio.denominator_s:17.1f} {1e3 * ratio.numerator_s:16.1f} {ratio.value:6.3f}")
    print("\nratio: one pass of 2B rows over two passes of B rows. Below 1, a fused forward could save at most "
          "1 - ratio of the prompt passes' time; at or above 1 it cannot win.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

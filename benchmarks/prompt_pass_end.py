"""
What does ending a prompt pass at its last layer's keys/values save (`peft_bitune/tuner/prompt_pass_end.py`)? Measured.

A prompt pass feeds nothing but the keys/values its layers write, so it may end right after the last layer's; without
that, the last layer's attention output and MLP and the final norm run for nothing. This script times Bitune's prefill
(both prompt passes and the mix, no gradients) and a training step (forward and backward) with the early stop and with
every pass run to its end, interleaved, on the same model and batch. The saving is about 1/L of each prompt pass for
L layers, so it matters on shallow shapes and little on deep ones:

    python benchmarks/prompt_pass_end.py                   # `small` and `smollm2` shapes, CPU, one thread
    python benchmarks/prompt_pass_end.py --model smollm2   # one shape
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from measure import Clock, Ratio, RoundPolicy, interleaved_rounds  # noqa: E402
from models import MODEL_SIZES, build_pair, prompt_batch, training_batch  # noqa: E402

CELLS = [(1, 128, 32), (8, 128, 32), (8, 32, 32)]  # (batch, prompt length, answer length)


def measure(name: str, clock: Clock, policy: RoundPolicy) -> None:
    """Print one row per workload and cell for the model shape `name`."""
    size = MODEL_SIZES[name]
    device = clock.device
    model = build_pair(size, device, torch.float32, "sdpa").bitune
    router = model.base_model._router
    may_stop = type(router).prompt_passes_may_stop_early

    def stopping(stop: bool) -> None:
        # The one decision the passes read: allowed as the model is wrapped (`may_stop`), or never.
        router.prompt_passes_may_stop_early = (lambda: may_stop(router)) if stop else (lambda: False)

    for batch_size, prompt_length, answer_length in CELLS:
        prompts = prompt_batch(batch_size, prompt_length, size.vocab_size, device)
        batch = training_batch(batch_size, prompt_length, answer_length, size.vocab_size, device)

        def prefill(stop: bool) -> dict[str, float]:
            stopping(stop)
            model.eval()
            return {"t": clock.timed(lambda: model.base_model.prefill(**prompts))}

        def training_step(stop: bool) -> dict[str, float]:
            stopping(stop)
            model.train()
            model.zero_grad(set_to_none=True)
            return {"t": clock.timed(lambda: model(**batch).loss.backward())}

        for workload, run in (("prefill", prefill), ("train step", training_step)):
            rounds = interleaved_rounds({"stop": lambda: run(True), "end": lambda: run(False)}, policy)
            ratio = Ratio.from_rounds(rounds, "stop/t", "end/t")
            print(f"{name:8s} {workload:10s} {batch_size:5d} {prompt_length:4d} {answer_length:4d} "
                  f"{1e3 * ratio.numerator_s:10.1f} {1e3 * ratio.denominator_s:14.1f} {ratio.value:6.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), action="append",
                        help="a model shape (repeat for several; default: small and smollm2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, help="rounds per cell (default: 7 to 15, within a time budget)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = Clock("cpu", torch.device("cpu"))
    policy = RoundPolicy(min_rounds=args.rounds or 7, max_rounds=args.rounds or 15, budget_s=60.0)
    print(f"{'model':8s} {'workload':10s} {'batch':>5s} {'P':>4s} {'A':>4s} {'stop ms':>10s} {'to the end ms':>14s} "
          f"{'ratio':>6s}")
    for name in args.model or ["small", "smollm2"]:
        measure(name, clock, policy)
    print("\nratio: with the early stop over without it (fastest of the interleaved rounds, CPU time); below 1 is the "
          "share it saves.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

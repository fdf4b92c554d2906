"""
Where Bitune's time goes, next to plain LoRA: operator tables from torch.profiler and Python call trees from cProfile.

    python benchmarks/profile_bitune.py --batch 8 --prompt 128 --answer 32          # one training step
    python benchmarks/profile_bitune.py --generation --batch 16 --prompt 128        # prefill and decoding

The operator table lists, per aten operator, LoRA's and Bitune's self CPU time and the difference, so what Bitune adds
beyond reading the prompt twice stands out. The Python profile shows the cumulative time of Bitune's own functions
(routing, layout, mixing, loss) and of the library calls under them. Measures one thread by default, like run.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from models import MODEL_SIZES, build_pair, prompt_batch, training_batch  # noqa: E402
from suites import train_step  # noqa: E402


def operator_times(function: Callable[[], object], repeats: int) -> dict[str, tuple[float, int]]:
    """Self CPU microseconds and call counts per operator, averaged over `repeats` calls (after one warm-up)."""
    function()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            function()
    return {e.key: (e.self_cpu_time_total / repeats, e.count // repeats) for e in prof.key_averages()}


def print_operator_diff(lora: dict, bitune: dict, top: int) -> None:
    total_lora = sum(t for t, _ in lora.values())
    total_bitune = sum(t for t, _ in bitune.values())
    print(f"\nSelf CPU per call: LoRA {total_lora / 1e3:.1f} ms, Bitune {total_bitune / 1e3:.1f} ms "
          f"(ratio {total_bitune / total_lora:.3f})")
    print(f"{'operator':48s} {'LoRA ms':>9s} {'calls':>6s} {'Bitune ms':>10s} {'calls':>6s} {'extra ms':>9s}")
    names = sorted(set(lora) | set(bitune), key=lambda n: -(bitune.get(n, (0, 0))[0] - lora.get(n, (0, 0))[0]))
    for name in names[:top]:
        (lt, lc), (bt, bc) = lora.get(name, (0.0, 0)), bitune.get(name, (0.0, 0))
        print(f"{name[:48]:48s} {lt / 1e3:9.2f} {lc:6d} {bt / 1e3:10.2f} {bc:6d} {(bt - lt) / 1e3:9.2f}")


def print_python_profile(function: Callable[[], object], repeats: int, top: int, pattern: str) -> None:
    """Cumulative time of the Python functions whose file matches `pattern` (a regular expression)."""
    function()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        function()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("cumulative").print_stats(pattern, top)
    print(f"\ncProfile over {repeats} calls, functions matching {pattern!r} (cumulative seconds, all calls):")
    print("\n".join(line for line in stream.getvalue().splitlines() if line.strip() and "function calls" not in line))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=sorted(MODEL_SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="Prompt length P.")
    parser.add_argument("--answer", type=int, default=32, help="Answer length A (training).")
    parser.add_argument("--generation", action="store_true", help="Profile prefill and decoding instead of training.")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = parser.parse_args(argv)
    for name in ("batch", "prompt", "answer", "repeats", "top", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2, got {args.new_tokens}.")

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    size = MODEL_SIZES[args.model]
    pair = build_pair(size, device, torch.float32, args.attn)
    if args.generation:
        prompts = prompt_batch(args.batch, args.prompt, size.vocab_size, device)
        for model in pair.both().values():
            model.eval()
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        workloads = {
            name: (lambda model=model: _generate(model, prompts, kwargs)) for name, model in pair.both().items()
        }
        prefills = {
            "lora": lambda: _generate(pair.lora, prompts, dict(kwargs, max_new_tokens=1, min_new_tokens=1)),
            "bitune": lambda: _generate(pair.bitune, prompts, dict(kwargs, max_new_tokens=1, min_new_tokens=1)),
        }
        print(f"Generation, batch {args.batch}, P={args.prompt}: generate(max_new_tokens=1), i.e. the prefill")
        print_operator_diff(operator_times(prefills["lora"], args.repeats),
                            operator_times(prefills["bitune"], args.repeats), args.top)
        print(f"\nGeneration, batch {args.batch}, P={args.prompt}, {args.new_tokens} new tokens")
        print_operator_diff(operator_times(workloads["lora"], args.repeats),
                            operator_times(workloads["bitune"], args.repeats), args.top)
        print_python_profile(prefills["bitune"], args.repeats, args.top, "peft_bitune|generation/utils|peft_model")
    else:
        batch = training_batch(args.batch, args.prompt, args.answer, size.vocab_size, device)
        for model in pair.both().values():
            model.train()
        print(f"Training step, batch {args.batch}, P={args.prompt}, A={args.answer}, "
              f"compute bound {(2 * args.prompt + args.answer) / (args.prompt + args.answer):.3f}")
        print_operator_diff(operator_times(lambda: train_step(pair.lora, batch), args.repeats),
                            operator_times(lambda: train_step(pair.bitune, batch), args.repeats), args.top)
        print_python_profile(lambda: train_step(pair.bitune, batch), args.repeats, args.top,
                             "peft_bitune|masking_utils|autograd")
    return 0


def _generate(model: torch.nn.Module, prompts: dict[str, torch.Tensor], kwargs: dict) -> None:
    with torch.no_grad():
        model.generate(**prompts, **kwargs)


if __name__ == "__main__":
    sys.exit(main())

"""
Bitune against plain PEFT LoRA, measured in the same process: training step, generation, batching, scaling.

    python benchmarks/run.py --quick --json out.json     # a few minutes on 2 CPU cores
    python benchmarks/run.py --json out.json             # the full grid, with tables
    python benchmarks/run.py --device cuda               # the same on a GPU (bfloat16, a ~1B Llama shape)

Every figure is a ratio against LoRA on identical copies of the same base model, with the same rank, batch and
lengths; see benchmarks/README.md for what each figure measures and how.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from measure import Clock, RoundPolicy  # noqa: E402
from models import MODEL_SIZES, build_pair  # noqa: E402
from suites import (  # noqa: E402
    BatchingCell,
    GenerationCell,
    TrainCell,
    measure_batching,
    measure_generation,
    measure_training,
)

PROMPT_ANSWER_LENGTHS = [(32, 32), (128, 32), (32, 128), (256, 256)]
NEW_TOKENS = 128



@dataclass(frozen=True)
class Grid:
    """The cells one run measures, and how many rounds each gets."""

    train: list[TrainCell]
    generation: list[GenerationCell]
    batching: list[BatchingCell]
    batching_with_lora: bool  # also measure LoRA's own batching speedup, for comparison
    policy: RoundPolicy


FULL_GRID = Grid(
    train=[TrainCell(b, p, a) for p, a in PROMPT_ANSWER_LENGTHS for b in (1, 8, 32)],
    generation=[GenerationCell(b, p, NEW_TOKENS) for p in (32, 128, 256) for b in (1, 16)],
    # Random lengths (the batch pays for its padding), then equal lengths (what batching itself saves).
    batching=[BatchingCell(16, (16, 128), (16, 128)), BatchingCell(16, (64, 64), (64, 64))],
    batching_with_lora=True,
    policy=RoundPolicy(min_rounds=3, max_rounds=9, budget_s=30.0),
)
# The quick run keeps the cells the targets are about (batch >= 8, batch 1 and 16 for generation) at lengths that fit
# its time limit; decoding is timed over 32 new tokens instead of 128. LoRA's own batching speedup is measured too: it
# says what batching can gain on this machine and model at all.
QUICK_GRID = Grid(
    train=[TrainCell(8, 32, 32), TrainCell(8, 128, 32)],
    generation=[GenerationCell(1, 128, 32), GenerationCell(16, 128, 32)],
    batching=[BatchingCell(16, (8, 40), (8, 40))],
    batching_with_lora=True,
    policy=RoundPolicy(min_rounds=3, max_rounds=7, budget_s=8.0),
)

# The targets; `scope` says which cells a target is about.
TARGETS = {
    "train_ratio_to_bound": dict(at_most=1.15, scope="training cells with batch >= 8"),
    "train_memory_ratio": dict(at_most=1.5, scope="every training cell"),
    "prefill_ratio": dict(at_most=2.2, scope="every generation cell"),
    "decode_ratio": dict(at_most=1.05, scope="every generation cell"),
    "batching_speedup": dict(at_least=5.0, scope="every batching cell (target set for CPU)"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="A few cells only (under 3 minutes on 2 CPU cores).")
    parser.add_argument("--json", type=Path, help="Write the results as a JSON object to this file.")
    parser.add_argument("--device", default="cpu", help="`cpu` or `cuda` (or `cuda:N`).")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="Model dtype; float32 on CPU and bfloat16 on CUDA by default.")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES),
                        help="Random Llama size; `small` on CPU and `medium` on CUDA by default.")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="Attention implementation.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine, several threads per process can run "
                             "small kernels many times slower, which makes timings erratic).")
    parser.add_argument("--clock", choices=Clock.KINDS,
                        help="`cpu` (process CPU time, steadier on a shared machine; the CPU default) or `wall` "
                             "(elapsed time; the only choice on CUDA).")
    parser.add_argument("--rounds", type=int,
                        help="Run exactly this many interleaved rounds per cell instead of the time-budgeted default.")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for, but this torch build sees no CUDA device.")
    args.device = device
    args.dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    args.model = args.model or ("small" if device.type == "cpu" else "medium")
    args.clock = args.clock or ("cpu" if device.type == "cpu" else "wall")
    if args.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu measures CPU work; time a GPU with --clock wall.")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}.")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}.")
    if args.json is not None and not args.json.parent.resolve().is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist; create it first.")
    return args


def run(args: argparse.Namespace) -> dict:
    """Build the model pair and run every cell of the chosen grid; returns the JSON-ready results."""
    torch.set_num_threads(args.threads)
    grid = QUICK_GRID if args.quick else FULL_GRID
    policy = grid.policy
    if args.rounds is not None:
        policy = RoundPolicy(min_rounds=args.rounds, max_rounds=args.rounds, budget_s=math.inf)
    started = time.perf_counter()
    pair = build_pair(MODEL_SIZES[args.model], args.device, args.dtype, args.attn)
    clock = Clock(args.clock, args.device)

    def progress(kind: str, row: dict) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {kind}: {_brief(row)}", file=sys.stderr, flush=True)

    results = dict(train=[], generation=[], batching=[])
    for cell in grid.train:
        results["train"].append(measure_training(pair, cell, policy, clock))
        progress("train", results["train"][-1])
    for cell in grid.generation:
        results["generation"].append(measure_generation(pair, cell, policy, clock))
        progress("generation", results["generation"][-1])
    for cell in grid.batching:
        results["batching"].append(measure_batching(pair, cell, policy, clock, with_lora=grid.batching_with_lora))
        progress("batching", results["batching"][-1])

    summary = summarize(results)
    return dict(
        **summary,
        targets=targets_met(results),
        settings=dict(
            quick=args.quick, device=str(args.device), dtype=str(args.dtype).removeprefix("torch."),
            model=args.model, model_size=vars(pair.size), attn_implementation=args.attn,
            lora_rank=pair.lora.peft_config["default"].r, threads=torch.get_num_threads(), clock=args.clock,
            rounds=dict(min=policy.min_rounds, max=policy.max_rounds,
                        budget_s=policy.budget_s if math.isfinite(policy.budget_s) else None),
        ),
        environment=dict(python=platform.python_version(), torch=torch.__version__,
                         transformers=transformers.__version__, peft=peft.__version__, machine=platform.machine(),
                         cpu_count=os.cpu_count()),
        **results,
        elapsed_s=time.perf_counter() - started,
    )


def summarize(results: dict) -> dict[str, float]:
    """The headline numbers: the worst case over the cells that ran (LoRA's batching speedup, for comparison, when
    it was measured)."""
    lora_batching = [row["lora_speedup"]["ratio"] for row in results["batching"] if "lora_speedup" in row]
    return dict(
        train_ratio_to_bound=max(row["ratio_to_bound"] for row in results["train"]),
        train_memory_ratio=max(row["memory_ratio"] for row in results["train"]),
        prefill_ratio=max(row["prefill"]["ratio"] for row in results["generation"]),
        decode_ratio=max(row["decode"]["ratio"] for row in results["generation"]),
        batching_speedup=min(row["bitune_speedup"]["ratio"] for row in results["batching"]),
        lora_batching_speedup=min(lora_batching) if lora_batching else None,
    )


def targets_met(results: dict) -> dict[str, dict]:
    """Each target with the worst value over the cells it is about, and whether that value meets it."""
    values = summarize(results)
    large_batches = [row["ratio_to_bound"] for row in results["train"] if row["batch_size"] >= 8]
    values["train_ratio_to_bound"] = max(large_batches) if large_batches else None
    report = {}
    for name, target in TARGETS.items():
        value = values[name]
        if value is None:
            met = None
        elif "at_most" in target:
            met = value <= target["at_most"]
        else:
            met = value >= target["at_least"]
        report[name] = dict(target, value=value, met=met)
    return report


def _brief(row: dict) -> str:
    keys = ("batch_size", "prompt_length", "answer_length", "ratio_to_bound", "memory_ratio")
    parts = [f"{k}={_fmt(row[k])}" for k in keys if k in row]
    for name in ("time", "prefill", "decode", "bitune_speedup", "lora_speedup"):
        if name in row:
            parts.append(f"{name}={_spread(row[name])}")
    return " ".join(parts)


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------------- tables
def print_tables(report: dict) -> None:
    settings = report["settings"]
    print(f"\nBitune vs LoRA (r={settings['lora_rank']}, all-linear), random Llama `{settings['model']}` "
          f"{settings['model_size']}, {settings['device']} {settings['dtype']} {settings['attn_implementation']}, "
          f"{settings['threads']} threads, {settings['clock']} clock. Ratios are Bitune/LoRA "
          f"(fastest run over fastest run, interleaved rounds), with the range of the per-round ratios in brackets; "
          f"times are the fastest runs.")

    _table(
        "Training step (forward + backward)",
        ["batch", "P", "A", "LoRA ms", "Bitune ms", "ratio [rounds]", "bound", "ratio/bound", "mem ratio",
         "linear FLOP ratio", "ratio/FLOPs"],
        [[r["batch_size"], r["prompt_length"], r["answer_length"], f"{1e3 * r['time']['denominator_s']:.1f}",
          f"{1e3 * r['time']['numerator_s']:.1f}", _spread(r["time"]), f"{r['compute_bound']:.3f}",
          f"{r['ratio_to_bound']:.3f}", f"{r['memory_ratio']:.3f}", f"{r['linear_flop_ratio']:.3f}",
          f"{r['ratio_to_linear_flops']:.3f}"] for r in report["train"]],
    )
    _table(
        "Generation (prefill = call to first logits; decode = per new token after that)",
        ["batch", "P", "new", "LoRA prefill ms", "prefill ratio", "LoRA decode ms/tok", "decode ratio"],
        [[r["batch_size"], r["prompt_length"], r["new_tokens"], f"{1e3 * r['prefill']['denominator_s']:.1f}",
          _spread(r["prefill"]), f"{1e3 * r['decode']['denominator_s']:.2f}", _spread(r["decode"])]
         for r in report["generation"]],
    )
    batching_rows = []
    for r in report["batching"]:
        for name in ("bitune", "lora"):
            if f"{name}_speedup" in r:
                batching_rows.append([name, r["batch_size"], f"{r['prompt_range']}", f"{r['answer_range']}",
                                      r["padded_length"], f"{r[f'{name}_examples_per_s']:.1f}",
                                      _spread(r[f"{name}_speedup"])])
    _table("Batching (training examples/s: one padded batch vs the same rows one at a time)",
           ["model", "batch", "P range", "A range", "padded len", "batched ex/s", "speedup"], batching_rows)
    _scaling_tables(report)

    print("\nTargets (worst case over the cells each is about):")
    for name, target in report["targets"].items():
        bound = f"<= {target['at_most']}" if "at_most" in target else f">= {target['at_least']}"
        value = "n/a" if target["value"] is None else f"{target['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[target["met"]]
        print(f"  {name:22s} {value:>8s}  target {bound:7s} ({target['scope']}): {verdict}")
    if report.get("lora_batching_speedup") is not None:
        print(f"  (LoRA's own batching speedup on the same rows: {report['lora_batching_speedup']:.3f})")


def _scaling_tables(report: dict) -> None:
    """Pivot tables: how ratio/bound and the memory ratio move with (P, A) and batch."""
    train = report["train"]
    batches = sorted({r["batch_size"] for r in train})
    lengths = sorted({(r["prompt_length"], r["answer_length"]) for r in train}, key=lambda pa: (pa[0] + pa[1], pa))
    if len(batches) > 1 or len(lengths) > 1:
        cells = {(r["prompt_length"], r["answer_length"], r["batch_size"]): r for r in train}
        for title, key in (("ratio / compute bound", "ratio_to_bound"), ("peak memory ratio", "memory_ratio"),
                           ("ratio / linear FLOP ratio", "ratio_to_linear_flops")):
            rows = []
            for p, a in lengths:
                row = [p, a, f"{(2 * p + a) / (p + a):.3f}"]
                row += [f"{cells[(p, a, b)][key]:.3f}" if (p, a, b) in cells else "-" for b in batches]
                rows.append(row)
            _table(f"Scaling of training {title}", ["P", "A", "bound"] + [f"batch {b}" for b in batches], rows)
    generation = report["generation"]
    batches = sorted({r["batch_size"] for r in generation})
    prompts = sorted({r["prompt_length"] for r in generation})
    if len(prompts) > 1:
        cells = {(r["prompt_length"], r["batch_size"]): r for r in generation}
        rows = []
        for p in prompts:
            row = [p]
            for b in batches:
                cell = cells.get((p, b))
                row += ([f"{cell['prefill']['ratio']:.3f}", f"{cell['decode']['ratio']:.3f}"] if cell else ["-", "-"])
            rows.append(row)
        headers = ["P"] + [f"{kind} b{b}" for b in batches for kind in ("prefill", "decode")]
        _table("Scaling of generation ratios", headers, rows)


def _spread(ratio: dict) -> str:
    """The ratio, then the range of the per-round ratios."""
    return f"{ratio['ratio']:.3f} [{ratio['round_ratio_min']:.2f}-{ratio['round_ratio_max']:.2f}]"


def _table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_tables(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        print(f"\nWrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

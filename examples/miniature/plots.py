"""
Pictures of an experiment's results JSON (from run.py): accuracy per task as bars with error bars, training loss
curves, and the learned mixing coefficients per layer.

    python examples/miniature/plots.py docs/miniature.json --prefix docs/images/miniature
    python examples/miniature/plots.py docs/results/smollm2.json --prefix docs/images/smollm2

writes `<prefix>_accuracy.png`, and, where the JSON has them, `<prefix>_loss.png` and `<prefix>_alphas.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
import tasks  # noqa: E402

from run import METHODS  # noqa: E402


def _title(name: str) -> str:
    return METHODS[name].title if name in METHODS else name


def plot_accuracy(results: dict, path: Path) -> None:
    """Grouped bars: one group per task (and the average), one bar per method; error bars are the sample standard
    deviation over seeds, the untuned base is a single bar without one."""
    summary = results["summary"]
    rows = [t for t in tasks.ALL_TASKS if t in summary["base"]] + ["average"]
    methods = ["base", *results["methods"]]
    width = 0.8 / len(methods)
    figure, axes = plt.subplots(figsize=(max(8.0, 0.45 * len(rows) * len(methods)), 4.6))
    for index, method in enumerate(methods):
        if method == "base":
            means, errors = [100 * summary["base"][row] for row in rows], None
        else:
            means = [100 * summary[method][row]["mean"] for row in rows]
            errors = [100 * (summary[method][row]["std"] or 0.0) for row in rows]
        positions = [i + (index - (len(methods) - 1) / 2) * width for i in range(len(rows))]
        axes.bar(positions, means, width, yerr=errors, capsize=2, label="untuned base" if method == "base"
                 else _title(method), color="0.75" if method == "base" else None)
    seeds = max(len(method["seeds"]) for method in results["methods"].values())
    axes.set_xticks(range(len(rows)), [row if row != "average" else "AVERAGE" for row in rows])
    axes.set_ylabel("accuracy (%)")
    axes.set_ylim(0, 102)
    axes.set_title(f"Accuracy per task, mean ± sample std over {seeds} seeds (test split)")
    axes.legend(fontsize=8, ncol=len(methods), loc="upper center", bbox_to_anchor=(0.5, -0.09), frameon=False)
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _per_seed(results: dict, key: str) -> dict[str, list]:
    """`key` of every seed of every method that has it (older results JSON files lack curves and alphas)."""
    found = {name: [seed[key] for seed in method["seeds"].values() if seed.get(key)]
             for name, method in results["methods"].items()}
    return {name: values for name, values in found.items() if values}


def plot_loss_curves(results: dict, path: Path) -> bool:
    """Training loss against step, one line per method (mean over its seeds, the range shaded)."""
    curves = _per_seed(results, "loss_curve")
    if not curves:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, runs in curves.items():
        steps = [step for step, _ in runs[0]]
        values = [[loss for _, loss in run] for run in runs if len(run) == len(steps)]
        mean = [statistics.fmean(column) for column in zip(*values)]
        axes.plot(steps, mean, label=f"{_title(name)} ({len(values)} seed{'s' if len(values) > 1 else ''})")
        if len(values) > 1:
            axes.fill_between(steps, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)], alpha=0.15)
    axes.set_xlabel("training step")
    axes.set_ylabel("training loss (answer tokens)")
    axes.set_yscale("log")
    axes.set_title("Training loss: mean over seeds, min-max shaded")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def plot_alphas(results: dict, path: Path) -> bool:
    """The learned mixing coefficients per layer (keys and values), mean over seeds, one line per Bitune method."""
    learned = _per_seed(results, "alphas")
    if not learned:
        return False
    figure, panels = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for panel, kind in zip(panels, ("keys", "values")):
        for name, runs in learned.items():
            mean = [statistics.fmean(layer) for layer in zip(*(run[kind] for run in runs))]
            panel.plot(range(len(mean)), mean, marker=".", label=_title(name))
        panel.set_title(f"{kind}: alpha per layer (mean over seeds)")
        panel.set_xlabel("layer")
        panel.grid(alpha=0.3)
    panels[0].set_ylabel("alpha = weight of the bidirectional cache")
    panels[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results JSON written by run.py --json")
    parser.add_argument("--prefix", required=True, help="output path prefix, e.g. docs/images/smollm2")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    written = [Path(f"{args.prefix}_accuracy.png")]
    plot_accuracy(results, written[0])
    for suffix, plot in (("loss", plot_loss_curves), ("alphas", plot_alphas)):
        if plot(results, Path(f"{args.prefix}_{suffix}.png")):
            written.append(Path(f"{args.prefix}_{suffix}.png"))
    print("\n".join(str(path) for path in written))


if __name__ == "__main__":
    main()

"""
The validation report of the recipe variants and of the larger budget's search (docs/paper_tasks.md, "Recipe
options beyond the paper"): merge the `--search_only` results of run.py into one JSON, compare every run with plain
Bitune and with LoRA of its stage and learning rate on the same validation rows (paired 95% bootstrap intervals over
rows), draw the loss curves and the learned alphas, and print the page's tables.

    python examples/paper_tasks/recipes_report.py out/variants_200.json out/search_600.json \
        --json docs/results/paper_tasks_recipes.json --images docs/images/paper_tasks_recipes

A stage is one training budget (steps, training rows, validation slices): runs of different stages are never
compared with each other.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PLAIN_BITUNE, LORA = "bitune_near_causal", "lora"
TRAIN_TASKS = ("arc_challenge", "csqa", "piqa", "siqa")  # the order of run.py's validation slice
FIELDS = ("train_loss", "train_seconds", "loss_curve", "alphas", "alpha_mean_curve", "validation_rows")


@functools.cache
def _report_module():
    spec = importlib.util.spec_from_file_location("paper_tasks_report", HERE / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_name(settings: dict) -> str:
    rows = settings.get("train_rows") or 4 * settings["train_rows_per_task"]
    return (f"{settings['steps']} steps, {rows} training rows, "
            f"{settings['validation_rows_per_task']} validation rows per task")


def per_task_rows(outcomes: str) -> dict[str, np.ndarray]:
    """A run's validation outcomes ("0"/"1" per row, tasks in run.py's order, equal slices) as (1, rows) arrays."""
    size = len(outcomes) // len(TRAIN_TASKS)
    return {task: np.array([[c == "1" for c in outcomes[i * size:(i + 1) * size]]], dtype=float)
            for i, task in enumerate(TRAIN_TASKS)}


def merge(inputs: list[dict]) -> dict:
    """Every run of every input, by stage, method and learning rate; with the paired differences where rows exist."""
    stages: dict[str, dict] = {}
    for results in inputs:
        if results.get("smoke"):
            raise SystemExit("--smoke results cannot go into the report: it is for full runs.")
        name = stage_name(results["settings"])
        stage = stages.setdefault(name, {"model": results["model"], "settings": results["settings"], "runs": {}})
        if stage["model"] != results["model"]:
            raise SystemExit(f"Stage {name!r} holds runs of {stage['model']} and {results['model']}.")
        for method, runs in results["search"].items():
            for lr, run in runs.items():
                stage["runs"].setdefault(method, {})[lr] = {
                    "validation": run["validation"], **{key: run[key] for key in FIELDS if key in run}}
    bootstrap = _report_module().paired_bootstrap
    for stage in stages.values():
        for method, runs in stage["runs"].items():
            for lr, run in runs.items():
                for reference in (PLAIN_BITUNE, LORA):
                    against = stage["runs"].get(reference, {}).get(lr)  # the same stage and learning rate
                    if against is None or against is run or not all("validation_rows" in r for r in (run, against)):
                        continue
                    run[f"minus_{reference}"] = bootstrap(per_task_rows(run["validation_rows"]),
                                                          per_task_rows(against["validation_rows"]))["average"]
    return {"stages": stages}


def _standard_error(accuracy: float, rows: int) -> float:
    return math.sqrt(accuracy * (1 - accuracy) / rows)


def _difference(run: dict, reference: str) -> str:
    difference = run.get(f"minus_{reference}")
    if difference is None:
        return "—"
    low, high = difference["ci95"]
    return f"{100 * difference['mean']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def markdown(report: dict) -> str:
    """One table per stage: validation accuracy (± its binomial standard error), training loss, mean learned alpha,
    and the paired differences from plain Bitune and from LoRA."""
    sections = []
    for name, stage in report["stages"].items():
        rows = stage["settings"]["validation_rows_per_task"] * len(TRAIN_TASKS)
        lines = [f"#### {stage['model']}: {name}", "",
                 "| Method | learning rate | validation accuracy | training loss | mean α (keys, values) "
                 "| − plain Bitune [95%] | − LoRA [95%] |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for method, runs in stage["runs"].items():
            for lr, run in runs.items():
                accuracy = run["validation"]["average"]
                alphas = run.get("alphas")
                alpha = "—" if alphas is None else (
                    f"{np.mean(alphas['keys']):.2f}, {np.mean(alphas['values']):.2f}")
                lines.append(f"| {method} | {lr} | {100 * accuracy:.1f} ± {100 * _standard_error(accuracy, rows):.1f} "
                             f"| {run['train_loss']:.3f} | {alpha} | {_difference(run, PLAIN_BITUNE)} "
                             f"| {_difference(run, LORA)} |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def figures(report: dict, prefix: str) -> list[str]:
    """Per stage: the training-loss curves and the learned alphas per layer of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for index, (name, stage) in enumerate(report["stages"].items()):
        figure, (loss_axis, alpha_axis) = plt.subplots(1, 2, figsize=(12, 3.8))
        for color, (method, runs) in enumerate(stage["runs"].items()):
            for lr, run in runs.items():
                label = method if len(runs) == 1 else f"{method} {lr}"
                steps, losses = zip(*run["loss_curve"])
                loss_axis.plot(steps, losses, color=f"C{color}", alpha=0.8, label=label)
                if "alphas" in run:
                    alpha_axis.plot(run["alphas"]["keys"], color=f"C{color}", label=f"{label}, keys")
                    alpha_axis.plot(run["alphas"]["values"], color=f"C{color}", linestyle="--")
        loss_axis.set(xlabel="step", ylabel="training loss (answer tokens)", title=name)
        loss_axis.legend(fontsize=7)
        alpha_axis.set(xlabel="layer", ylabel="learned α (keys solid, values dashed)", title="learned α per layer")
        alpha_axis.legend(fontsize=7)
        figure.tight_layout()
        written.append(_report_module().save_figure(figure, f"{prefix}_{index}.png"))
        plt.close(figure)
    return written


def main(argv: list[str] | None = None) -> None:
    report = _report_module().report_from_command_line(
        argv, __doc__.split("\n\n")[0], "--json files of `run.py --search_only`",
        "draw <IMAGES>_<stage number>.png", merge, figures)
    print(markdown(report))


if __name__ == "__main__":
    main()

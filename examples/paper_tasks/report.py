"""
The report of the paper-tasks experiment: merge the per-model results of run.py into one JSON, with the Bitune - LoRA
difference of every task and its 95% interval, draw the figures, and print the tables of docs/paper_tasks.md.

    python examples/paper_tasks/report.py out/paper_smollm2.json out/paper_gemma.json \
        --json docs/results/paper_tasks.json --images docs/images/paper_tasks

The interval is a paired bootstrap over test rows and seeds: each of 10,000 draws resamples the test rows of every
task (the same rows for both methods: the pairing) and, for each method, its seeds (with replacement), and takes the
difference of the mean accuracies. Bitune is "ahead" when the whole interval is above 0, "behind" when it is below,
"level" otherwise. The average over tasks resamples within each task and averages the per-task differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

METHODS = ("base", "lora", "bitune")
TITLES = {"base": "Base (untuned)", "lora": "LoRA", "bitune": "Bitune"}
TASK_TITLES = {"piqa": "PIQA", "arc_challenge": "ARC-Challenge", "csqa": "CommonsenseQA", "siqa": "SIQA",
               "mmlu": "MMLU", "average": "Average"}
DRAWS = 10_000
TRAINING_FIELDS = ("train_loss", "train_seconds", "seconds_per_step", "loss_curve", "alphas", "alpha_mean_curve")


def outcomes(per_model: dict, method: str) -> dict[str, np.ndarray]:
    """Per task, the (seeds, rows) 0/1 outcomes of a method (one row of seeds for the base)."""
    records = [per_model["base"]] if method == "base" else list(per_model["runs"][method].values())
    return {task: np.array([[row == "1" for row in record["test"]["rows"][task]] for record in records], dtype=float)
            for task in per_model["tasks"]}


def accuracies(per_model: dict, method: str) -> dict[str, list[float]]:
    """Per task and for the average over tasks: one accuracy per seed."""
    per_task = {task: array.mean(axis=1).tolist() for task, array in outcomes(per_model, method).items()}
    per_task["average"] = np.mean([per_task[task] for task in per_model["tasks"]], axis=0).tolist()
    return per_task


def paired_bootstrap(bitune: dict[str, np.ndarray], lora: dict[str, np.ndarray], seed: int = 0) -> dict:
    """The Bitune - LoRA difference per task and on average over tasks, with 95% intervals (see the module doc)."""
    rng = np.random.default_rng(seed)
    tasks = list(bitune)
    draws = {task: np.empty(DRAWS) for task in tasks}
    for draw in range(DRAWS):
        seeds_b = rng.integers(0, bitune[tasks[0]].shape[0], bitune[tasks[0]].shape[0])
        seeds_l = rng.integers(0, lora[tasks[0]].shape[0], lora[tasks[0]].shape[0])
        for task in tasks:
            rows = rng.integers(0, bitune[task].shape[1], bitune[task].shape[1])
            draws[task][draw] = bitune[task][np.ix_(seeds_b, rows)].mean() - lora[task][np.ix_(seeds_l, rows)].mean()
    draws["average"] = np.mean([draws[task] for task in tasks], axis=0)
    observed = {task: bitune[task].mean() - lora[task].mean() for task in tasks}
    observed["average"] = float(np.mean(list(observed.values())))
    result = {}
    for task, values in draws.items():
        low, high = np.percentile(values, [2.5, 97.5])
        verdict = "ahead" if low > 0 else "behind" if high < 0 else "level"
        result[task] = {"mean": float(observed[task]), "ci95": [float(low), float(high)], "verdict": verdict}
    return result


def merge(inputs: list[dict]) -> dict:
    names = [per_model["model"] for per_model in inputs]
    if len(set(names)) != len(names):
        raise SystemExit(f"Two inputs are results of the same model: {names}.")
    smoke = [per_model["model"] for per_model in inputs if per_model.get("smoke")]
    if smoke:
        raise SystemExit(f"{smoke} are --smoke results: the report is for full runs.")
    tasks = inputs[0]["tasks"]
    report = {"models": {}, "seeds": inputs[0]["seeds"], "tasks": tasks, "n_test": {}, "results": {},
              "bitune_minus_lora": {}, "training": {}, "test_rows": {}}
    for per_model in inputs:
        name = per_model["model"]
        if per_model["tasks"] != tasks or per_model["seeds"] != report["seeds"]:
            raise SystemExit(f"{name} ran other tasks or seeds than {inputs[0]['model']}: they cannot share a table.")
        report["models"][name] = {
            "source": per_model["source"], "settings": per_model["settings"], "chosen": per_model["chosen"],
            "n_train": per_model["n_train"], "n_validation": per_model["n_validation"],
            "seconds": per_model["seconds"], "versions": per_model["versions"],
            "search": {method: {lr: {"validation_average": run["validation"]["average"],
                                     "train_loss": run["train_loss"]} for lr, run in runs.items()}
                       for method, runs in per_model["search"].items()},
        }
        report["n_test"][name] = per_model["n_test"]
        report["results"][name] = {method: accuracies(per_model, method) for method in METHODS}
        report["bitune_minus_lora"][name] = paired_bootstrap(outcomes(per_model, "bitune"),
                                                             outcomes(per_model, "lora"))
        report["training"][name] = {
            method: {seed: {key: record[key] for key in TRAINING_FIELDS if key in record}
                     | {"test_seconds": record["test"]["test_seconds"]}
                     for seed, record in per_model["runs"][method].items()}
            for method in ("lora", "bitune")
        }
        report["test_rows"][name] = {
            "base": per_model["base"]["test"]["rows"],
            **{method: {seed: record["test"]["rows"] for seed, record in per_model["runs"][method].items()}
               for method in ("lora", "bitune")},
        }
    return report


def mean_and_spread(values: list[float]) -> str:
    """Accuracies over seeds as a percentage: the mean, and the sample standard deviation when there are several."""
    mean = 100 * statistics.fmean(values)
    return f"{mean:.1f}" if len(values) == 1 else f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}"


def markdown(report: dict) -> str:
    """One table per model: accuracy per task (mean ± sample std over seeds) and the difference with its interval."""
    sections = []
    for name, results in report["results"].items():
        lines = [f"### {name}", "",
                 "| Task | test rows | Base (untuned) | LoRA | Bitune | Bitune − LoRA [95% interval] | |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for task in [*report["tasks"], "average"]:
            difference = report["bitune_minus_lora"][name][task]
            low, high = difference["ci95"]
            rows = report["n_test"][name].get(task, sum(report["n_test"][name].values()))
            title = f"**{TASK_TITLES[task]}**" if task == "average" else TASK_TITLES[task]
            cells = " | ".join(mean_and_spread(results[method][task]) for method in METHODS)
            lines.append(f"| {title} | {rows} | {cells} | {100 * difference['mean']:+.1f} "
                         f"[{100 * low:+.1f}, {100 * high:+.1f}] | {difference['verdict']} |")
        chosen = report["models"][name]["chosen"]
        start = chosen["bitune_start"]
        lines += ["", f"Chosen on the validation slice: LoRA learning rate {chosen['learning_rate']['lora']:g}, "
                      f"Bitune `{start}` at {chosen['learning_rate'][start]:g}."]
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def search_table(report: dict) -> str:
    lines = ["| Model | Method | learning rate | validation accuracy | training loss (mean over the run) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for name, model in report["models"].items():
        for method, runs in model["search"].items():
            for lr, run in runs.items():
                lines.append(f"| {name} | {method} | {lr} | {100 * run['validation_average']:.1f} "
                             f"| {run['train_loss']:.3f} |")
    return "\n".join(lines)


def figures(report: dict, prefix: str) -> list[str]:
    """Accuracy bars, the differences with their intervals, loss curves and learned alphas; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, tasks = list(report["results"]), [*report["tasks"], "average"]
    written = []

    figure, axes = plt.subplots(len(names), 1, figsize=(9, 3.2 * len(names)), squeeze=False)
    for axis, name in zip(axes[:, 0], names):
        width = 0.27
        for offset, method in enumerate(METHODS):
            values = report["results"][name][method]
            means = [100 * statistics.fmean(values[task]) for task in tasks]
            errors = [100 * statistics.stdev(values[task]) if len(values[task]) > 1 else 0 for task in tasks]
            axis.bar(np.arange(len(tasks)) + (offset - 1) * width, means, width, yerr=errors, capsize=2,
                     label=TITLES[method])
        axis.set_xticks(np.arange(len(tasks)), [TASK_TITLES[task] for task in tasks])
        axis.set_ylabel("accuracy (%)")
        axis.set_title(name)
        axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    written.append(save_figure(figure, f"{prefix}_accuracy.png"))

    figure, axis = plt.subplots(figsize=(8, 3.5))
    for offset, name in enumerate(names):
        differences = report["bitune_minus_lora"][name]
        means = [100 * differences[task]["mean"] for task in tasks]
        lows = [100 * (differences[task]["mean"] - differences[task]["ci95"][0]) for task in tasks]
        highs = [100 * (differences[task]["ci95"][1] - differences[task]["mean"]) for task in tasks]
        axis.errorbar(np.arange(len(tasks)) + 0.15 * (offset - (len(names) - 1) / 2), means, yerr=[lows, highs],
                      fmt="o", capsize=3, label=name)
    axis.axhline(0, color="gray", linewidth=0.8)
    axis.set_xticks(np.arange(len(tasks)), [TASK_TITLES[task] for task in tasks])
    axis.set_ylabel("Bitune − LoRA (points)")
    axis.set_title("Bitune − LoRA, mean over seeds, 95% paired bootstrap interval")
    axis.legend(fontsize=8)
    figure.tight_layout()
    written.append(save_figure(figure, f"{prefix}_difference.png"))

    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.2), squeeze=False)
    for axis, name in zip(axes[0], names):
        for method in ("lora", "bitune"):
            for index, record in enumerate(report["training"][name][method].values()):
                steps, losses = zip(*record["loss_curve"])
                axis.plot(steps, losses, color="C0" if method == "lora" else "C1", alpha=0.7,
                          label=TITLES[method] if index == 0 else None)
        axis.set_xlabel("step")
        axis.set_ylabel("training loss (answer tokens)")
        axis.set_title(name)
        axis.legend(fontsize=8)
    figure.tight_layout()
    written.append(save_figure(figure, f"{prefix}_loss.png"))

    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.2), squeeze=False)
    for axis, name in zip(axes[0], names):
        for kind, color in (("keys", "C2"), ("values", "C3")):
            for index, record in enumerate(report["training"][name]["bitune"].values()):
                axis.plot(record["alphas"][kind], color=color, alpha=0.7, label=kind if index == 0 else None)
        axis.set_xlabel("layer")
        axis.set_ylabel("learned α (weight of the bidirectional cache)")
        axis.set_title(f"{name}: {report['models'][name]['chosen']['bitune_start']}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    written.append(save_figure(figure, f"{prefix}_alphas.png"))
    return written


def save_figure(figure, path: str) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def report_from_command_line(argv: list[str] | None, description: str, inputs_help: str, images_help: str,
                             merge_inputs, draw) -> dict:
    """The command line of a report (this one and recipes_report.py): merge the input files with `merge_inputs`,
    write the merged JSON (`--json`) and the figures `draw` makes (`--images`); returns the report."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("inputs", nargs="+", help=inputs_help)
    parser.add_argument("--json", help="write the merged report here")
    parser.add_argument("--images", help=images_help)
    args = parser.parse_args(argv)
    missing = [path for path in args.inputs if not Path(path).is_file()]
    if missing:
        parser.error(f"no such results file: {', '.join(missing)}")
    report = merge_inputs([json.loads(Path(path).read_text()) for path in args.inputs])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.images:
        for path in draw(report, args.images):
            print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> None:
    report = report_from_command_line(
        argv, __doc__.split("\n\n")[0], "the --json files of examples/paper_tasks/run.py, one per model",
        "draw the figures as <IMAGES>_accuracy.png, ..._difference.png, ...", merge, figures)
    print(markdown(report))
    print()
    print(search_table(report))


if __name__ == "__main__":
    main()

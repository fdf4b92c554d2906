"""
The 200-step page's runs beside runs at another budget or precision, on the same test rows: docs/paper_tasks.md's
"A larger budget and a parameter-matched LoRA" (a 600-step run of run.py with LoRA, LoRA r=16, Bitune and the
variant that validation chose, separate learning rates) and its bf16 accuracy (a 200-step run of run.py with
`--bf16`). It writes one JSON with every run's outcomes, draws the loss curves and the learned alphas, and prints the
page's tables. Each run is labelled by its steps, and `bf16` where it trained under bf16 autocast: "200", "600",
"200-bf16".

    python examples/paper_tasks/run.py --base smollm2 --steps 600 --train_rows 4800 --validation_rows_per_task 100 \
        --methods lora lora_r16 bitune_near_causal bitune_lr_ratios --bitune_lr_from_lora \
        --work_dir out/paper_tasks/smollm2 --json out/paper_smollm2_600.json
    python examples/paper_tasks/budget_report.py docs/results/paper_tasks.json out/paper_smollm2_600.json \
        --json docs/results/paper_tasks_budget.json --images docs/images/paper_tasks_budget

    python examples/paper_tasks/run.py --base smollm2 --bf16 --methods lora bitune_near_causal \
        --learning_rates 1.5e-3 --work_dir out/paper_tasks/smollm2 --json out/paper_smollm2_bf16.json
    python examples/paper_tasks/budget_report.py docs/results/paper_tasks.json out/paper_smollm2_bf16.json \
        --json docs/results/paper_tasks_bf16.json --images docs/images/paper_tasks_bf16

Several run.py results of one setting share its columns when each holds other methods, trained the same way: a
method whose later seeds have not run yet comes from its own run.py command with fewer `--seeds`, and its column
names its seeds.

Every difference is report.py's paired bootstrap (test rows paired, each side's seeds resampled): Bitune and the
variant against LoRA and against LoRA r=16 in each setting, the variant against Bitune, and each method's runs in a
later setting against its 200-step float32 runs (600 − 200 steps; bf16 − float32).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
METHODS = ("lora", "lora_r16", "bitune", "bitune_lr_ratios")
TITLES = {"lora": "LoRA", "lora_r16": "LoRA r=16", "bitune": "Bitune", "bitune_lr_ratios": "Bitune, separate rates"}
# (method, control): each difference reported at every budget that ran both
COMPARISONS = (("bitune", "lora"), ("bitune", "lora_r16"), ("bitune_lr_ratios", "lora"),
               ("bitune_lr_ratios", "lora_r16"), ("bitune_lr_ratios", "bitune"))
KEPT = ("train_loss", "train_seconds", "seconds_per_step", "loss_curve", "alphas", "alpha_mean_curve")


@functools.cache
def _report_module():
    spec = importlib.util.spec_from_file_location("paper_tasks_report", HERE / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def label(settings: dict) -> str:
    """A setting's key in the report: its steps, and `-bf16` where it trained under bf16 autocast."""
    return f"{settings['steps']}" + ("-bf16" if settings.get("bf16") else "")


def title(setting: str) -> str:
    """A label as the page writes it: "600 steps", "200 steps, bf16"."""
    steps, _, precision = setting.partition("-")
    return f"{steps} steps" + (f", {precision}" if precision else "")


def change(later: str, first: str) -> str:
    """What a difference between two settings changes: "600 − 200 steps", "bf16 − float32, 200 steps"."""
    (later_steps, _, later_precision), (first_steps, _, first_precision) = later.partition("-"), first.partition("-")
    if later_precision == first_precision:
        return f"{later_steps} − {first_steps} steps" + (f", {later_precision}" if later_precision else "")
    if later_steps == first_steps:
        return f"{later_precision or 'float32'} − {first_precision or 'float32'}, {later_steps} steps"
    return f"{title(later)} − {title(first)}"


def _from_merged_report(report: dict, model: str) -> dict:
    """One budget's runs out of report.py's merged JSON (the 200-step page)."""
    if model not in report["test_rows"]:
        raise SystemExit(f"The merged report has no results of {model} (it has {', '.join(report['test_rows'])}).")
    runs = {method: {seed: {"rows": rows, **report["training"][model][method][seed]}
                     for seed, rows in report["test_rows"][model][method].items()}
            for method in METHODS if method in report["test_rows"][model]}
    return {"settings": report["models"][model]["settings"], "n_test": report["n_test"][model], "runs": runs}


def _from_run(results: dict) -> dict:
    """One budget's runs out of run.py's --json."""
    unknown = sorted(set(results["runs"]) - set(METHODS))
    if unknown:
        raise SystemExit(f"This report compares {', '.join(METHODS)}; the results also hold {', '.join(unknown)}: "
                         "leave them out of run.py's --methods.")
    runs = {method: {seed: {"rows": record["test"]["rows"], **{key: record[key] for key in KEPT if key in record}}
                     for seed, record in results["runs"][method].items()}
            for method in METHODS if method in results["runs"]}
    return {"settings": results["settings"], "n_test": results["n_test"], "runs": runs}


def _same_setting(earlier: dict, budget: dict, setting: str) -> dict:
    """Two run.py results of one setting as one: each holds other methods (say, a method whose later seeds have not
    run yet, given with fewer --seeds), trained the same way."""
    shared = sorted(set(earlier["runs"]) & set(budget["runs"]))
    if shared:
        raise SystemExit(f"Two results of the setting {setting} both hold {', '.join(shared)}: give each method "
                         "once (run.py's --json of all its seeds).")
    varying = ("seeds", "learning_rates", "threads")  # which runs a command makes, not how they train
    first, second = ({name: value for name, value in results["settings"].items() if name not in varying}
                     for results in (earlier, budget))
    if first != second:
        differing = sorted(name for name in first.keys() | second.keys() if first.get(name) != second.get(name))
        raise SystemExit(f"Two results of the setting {setting} were trained differently ({', '.join(differing)}): "
                         "they cannot share a table.")
    runs = {**earlier["runs"], **budget["runs"]}
    return {**earlier, "runs": {method: runs[method] for method in METHODS if method in runs}}


def _outcomes(budget: dict, method: str, tasks: list[str]) -> dict[str, np.ndarray]:
    records = budget["runs"][method].values()
    return {task: np.array([[row == "1" for row in record["rows"][task]] for record in records], dtype=float)
            for task in tasks}


def merge(inputs: list[dict]) -> dict:
    """The merged 200-step report first, then run.py's results in the other setting(s), all of one model."""
    first, *later = inputs
    if "test_rows" not in first or not later or any("runs" not in results for results in later):
        raise SystemExit("Give report.py's merged JSON (the 200-step page) first, then run.py's --json results of "
                         "the other setting (a larger budget, or bf16).")
    if any(results.get("smoke") for results in later):
        raise SystemExit("--smoke results cannot go into the report: it is for full runs.")
    model, tasks = later[0]["model"], first["tasks"]
    shortest = _from_merged_report(first, model)
    budgets = {label(shortest["settings"]): shortest}
    for results in later:
        if results["model"] != model or results["tasks"] != tasks:
            raise SystemExit(f"All results must be of {model} on {tasks}; got {results['model']} on "
                             f"{results['tasks']}.")
        setting, budget = label(results["settings"]), _from_run(results)
        if setting in budgets:
            budget = _same_setting(budgets[setting], budget, title(setting))
        budgets[setting] = budget
    test_sets = {setting: (budget["n_test"], budget["settings"]["test_rows"],
                         budget["settings"]["mmlu_rows_per_subject"]) for setting, budget in budgets.items()}
    if len({repr(test_set) for test_set in test_sets.values()}) != 1:
        raise SystemExit(f"The budgets were scored on different test rows ({test_sets}): run them with the same "
                         "--test_rows and --mmlu_rows_per_subject.")
    bootstrap, accuracies = _report_module().paired_bootstrap, {}
    for setting, budget in budgets.items():
        accuracies[setting] = {}
        for method in budget["runs"]:
            per_task = {task: array.mean(axis=1).tolist() for task, array in _outcomes(budget, method, tasks).items()}
            per_task["average"] = np.mean([per_task[task] for task in tasks], axis=0).tolist()
            accuracies[setting][method] = per_task
    differences = {}
    for setting, budget in budgets.items():
        for method, control in COMPARISONS:
            if {method, control} <= set(budget["runs"]):
                differences[f"{TITLES[method]} − {TITLES[control]}, {title(setting)}"] = bootstrap(
                    _outcomes(budget, method, tasks), _outcomes(budget, control, tasks))
    (shortest_setting, _), *longer = budgets.items()
    for setting, budget in longer:
        for method in METHODS:
            if method in budget["runs"] and method in shortest["runs"]:
                differences[f"{TITLES[method]}, {change(setting, shortest_setting)}"] = bootstrap(
                    _outcomes(budget, method, tasks), _outcomes(shortest, method, tasks))
    return {"model": model, "tasks": tasks, "n_test": shortest["n_test"], "budgets": budgets,
            "accuracy": accuracies, "differences": differences}


def markdown(report: dict) -> str:
    """The accuracy of every method in every setting (mean ± std over seeds), then every difference with its
    interval. Methods may have run different numbers of seeds: the intervals resample each side's own."""
    task_titles = _report_module().TASK_TITLES
    columns = [(setting, method) for setting, per_method in report["accuracy"].items() for method in per_method]
    seeds = {column: len(report["budgets"][column[0]]["runs"][column[1]]) for column in columns}

    def heading(setting: str, method: str) -> str:  # the seeds are named where a column has other than the first's
        count = seeds[setting, method]
        other = f" ({count} seed{'s' if count > 1 else ''})" if count != seeds[columns[0]] else ""
        return f"{TITLES[method]}, {title(setting)}{other}"

    lines = ["| Task | test rows | " + " | ".join(heading(s, m) for s, m in columns) + " |",
             "| --- | ---: |" + " ---: |" * len(columns)]
    for task in [*report["tasks"], "average"]:
        rows = report["n_test"].get(task, sum(report["n_test"].values()))
        task_title = f"**{task_titles[task]}**" if task == "average" else task_titles[task]
        spread = _report_module().mean_and_spread
        cells = [spread(report["accuracy"][setting][method][task]) for setting, method in columns]
        lines.append(f"| {task_title} | {rows} | " + " | ".join(cells) + " |")
    lines += ["", "| Difference [95% interval] | " + " | ".join(task_titles[t] for t in report["tasks"])
              + " | **Average** | |", "| --- |" + " ---: |" * (len(report["tasks"]) + 1) + " --- |"]
    for name, difference in report["differences"].items():
        cells = [f"{100 * difference[t]['mean']:+.1f} [{100 * difference[t]['ci95'][0]:+.1f}, "
                 f"{100 * difference[t]['ci95'][1]:+.1f}]" for t in [*report["tasks"], "average"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {difference['average']['verdict']} |")
    return "\n".join(lines)


def figures(report: dict, prefix: str) -> list[str]:
    """The training-loss curves of every method and setting (mean over seeds), and Bitune's learned alphas per
    layer in each setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, alpha_axis) = plt.subplots(1, 2, figsize=(12, 3.8))
    for style, (setting, budget) in zip(("--", "-", ":"), report["budgets"].items()):
        for color, method in enumerate(METHODS):
            seeds = [run for run in budget["runs"].get(method, {}).values() if "loss_curve" in run]
            if seeds:
                steps_axis = [step for step, _ in seeds[0]["loss_curve"]]
                mean = np.mean([[loss for _, loss in run["loss_curve"]] for run in seeds], axis=0)
                loss_axis.plot(steps_axis, mean, f"C{color}{style}", label=f"{TITLES[method]}, {title(setting)}")
            alphas = [run["alphas"] for run in seeds if "alphas" in run]
            if alphas:
                for kind, marker in (("keys", "o"), ("values", "x")):
                    alpha_axis.plot(np.mean([a[kind] for a in alphas], axis=0), f"C{color}{style}", marker=marker,
                                    markersize=3, label=f"{TITLES[method]}, {kind}, {title(setting)}")
    loss_axis.set(xlabel="step", ylabel="training loss (answer tokens)", title=f"{report['model']}: mean over seeds")
    alpha_axis.set(xlabel="layer", ylabel="learned α (mean over seeds)", title="Bitune's learned α per layer")
    for axis in (loss_axis, alpha_axis):
        axis.legend(fontsize=7)
    figure.tight_layout()
    path = _report_module().save_figure(figure, f"{prefix}.png")
    plt.close(figure)
    return [path]


def main(argv: list[str] | None = None) -> None:
    report = _report_module().report_from_command_line(
        argv, __doc__.split("\n\n")[0], "report.py's merged JSON (the 200-step page), then run.py's --json of the "
        "other setting (a larger budget, or bf16)", "draw <IMAGES>.png", merge, figures)
    print(markdown(report))


if __name__ == "__main__":
    main()

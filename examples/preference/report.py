"""
The report of the DPO-after-SFT experiment (examples/preference/dpo.py): from the records present, each method's test
accuracy before and after DPO with the paired 95% interval of after − before, and the held-out reward curves.

    python examples/preference/report.py --json docs/results/preference.json --page docs/preference.md

Runs still in progress are reported as such: the JSON and the page's generated block list which records exist, and
hold only the numbers those records give. The interval is examples/paper_tasks/report.py's paired bootstrap over the
test rows (10,000 draws, the same rows before and after: one seed, so only the rows are resampled).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parents[1]
RECORDS = REPOSITORY / "docs" / "results" / "preference_runs" / "smollm2"
PAPER_RUNS = REPOSITORY / "docs" / "results" / "paper_tasks_runs" / "smollm2"
STAGES = ("sft", "before", "dpo", "after")
METHODS = ("bitune", "lora")
TITLES = {"bitune": "Bitune", "lora": "LoRA"}
STAGE_TITLES = {"sft": "SFT", "before": "test scores before DPO", "dpo": "DPO", "after": "test scores after DPO"}
TASK_TITLES = {"piqa": "PIQA", "arc_challenge": "ARC-Challenge", "csqa": "CommonsenseQA", "siqa": "SIQA",
               "mmlu": "MMLU", "average": "Average"}
PAGE_START = "<!-- preference-report:start (written by examples/preference/report.py --page; do not edit) -->"
PAGE_END = "<!-- preference-report:end -->"


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


paper_report = _load("paper_tasks_report", HERE.parent / "paper_tasks" / "report.py")


def read_records(directory: Path) -> dict[str, dict[str, tuple[str, dict]]]:
    """Per method and stage, the record's file name and content; refuses two records of one stage."""
    if not directory.is_dir():
        raise SystemExit(f"{directory} is not a folder of records (examples/preference/dpo.py writes them).")
    found: dict[str, dict[str, tuple[str, dict]]] = {}
    for path in sorted(directory.glob("*.json")):
        record = json.loads(path.read_text())
        method, stage = record.get("method"), record.get("stage")
        if method not in METHODS or stage not in STAGES:
            raise SystemExit(f"{path} is not a record of examples/preference/dpo.py (method {method!r}, stage "
                             f"{stage!r}).")
        stages = found.setdefault(method, {})
        if stage in stages:
            raise SystemExit(f"{directory} holds two {method} {stage} records ({stages[stage][0]} and {path.name}): "
                             "one chain per method; move the other settings' records to a folder of their own.")
        stages[stage] = (path.name, record)
    for method, stages in found.items():
        fingerprints = {stage: record["fingerprints"] for stage, (_, record) in stages.items()}
        for name in ("training", "scoring"):
            values = {f[name] for stage, f in fingerprints.items() if name == "training" or stage in ("before",
                                                                                                    "after")}
            if len(values) > 1:
                raise SystemExit(f"{method}'s records have different {name} fingerprints {sorted(values)}: they are "
                                 "not one chain.")
        dpo = {fingerprints[stage]["dpo"] for stage in ("dpo", "after") if stage in fingerprints}
        if len(dpo) > 1:
            raise SystemExit(f"{method}'s DPO and after-DPO records have different DPO fingerprints {sorted(dpo)}.")
    return found


def outcomes(record: dict) -> dict[str, np.ndarray]:
    """Per task, the (1, rows) 0/1 outcomes of a test record."""
    return {task: np.array([[row == "1" for row in rows]], dtype=float) for task, rows in record["rows"].items()}


def accuracy(record: dict) -> dict[str, float]:
    values = {task: float(np.mean([row == "1" for row in rows])) for task, rows in record["rows"].items()}
    values["average"] = float(np.mean(list(values.values())))
    return values


def paper_tasks_rows(name: str, before: dict, runs: Path = PAPER_RUNS) -> dict[str, str] | None:
    """The test rows' outcomes of the paper-tasks page's own run of the SFT adapter (same fingerprints, method, rate
    and seed), when that page has its test record of the same rows; None otherwise."""
    suffix = f"-sft-test{before['fingerprints']['scoring']}.json"
    if before["smoke"] or not name.endswith(suffix):
        return None
    path = runs / (name[: -len(suffix)] + f"-test{before['fingerprints']['scoring']}.json")
    if not path.is_file():
        return None
    page = json.loads(path.read_text())["rows"]
    if {task: len(rows) for task, rows in page.items()} != {task: len(rows) for task, rows in before["rows"].items()}:
        return None
    return page


def paper_tasks_agreement(name: str, before: dict, runs: Path = PAPER_RUNS) -> int | None:
    """How many test rows' outcomes of the SFT adapter differ from those of the paper-tasks page's own run of the same
    adapter, when that page has its test record; None otherwise."""
    page = paper_tasks_rows(name, before, runs)
    if page is None:
        return None
    return sum(a != b for task, rows in before["rows"].items() for a, b in zip(rows, page[task]))


def gain_difference(report: dict) -> dict | None:
    """Bitune's after − before minus LoRA's, per task and on average, with paired 95% intervals over the test rows
    both methods share (each row's change for Bitune against its change for LoRA); None until both are tested."""
    entries = [report["methods"].get(method, {}) for method in METHODS]
    if not all("before" in entry and "after" in entry for entry in entries):
        return None
    gains = []
    for entry in entries:
        after, before = outcomes({"rows": entry["after"]["rows"]}), outcomes({"rows": entry["before"]["rows"]})
        gains.append({task: after[task] - before[task] for task in before})
    return paper_report.paired_bootstrap(*gains)


def build(directory: Path) -> dict:
    found = read_records(directory)
    if not found:
        raise SystemExit(f"{directory} holds no records yet.")
    any_record = next(record for stages in found.values() for _, record in stages.values())
    report = {"model": any_record["model"], "smoke": any(record["smoke"] for stages in found.values()
                                                         for _, record in stages.values()),
              "records": {method: {stage: found.get(method, {}).get(stage, (None,))[0] for stage in STAGES}
                          for method in METHODS},
              "sft_settings": any_record["settings"], "methods": {}}
    report["complete"] = all(name is not None for stages in report["records"].values() for name in stages.values())
    for method in METHODS:
        stages = {stage: record for stage, (_, record) in found.get(method, {}).items()}
        entry: dict = {}
        if "sft" in stages:
            sft = stages["sft"]
            entry["sft"] = {"paper_method": sft["paper_method"], "learning_rate": sft["sft_learning_rate"],
                            "train_loss": sft["train_loss"], "train_seconds": sft["train_seconds"],
                            "paper_tasks_train_loss": sft.get("paper_tasks_record", {}).get("train_loss")}
        if "dpo" in stages:
            dpo = stages["dpo"]
            entry["dpo"] = {"trainer": dpo["trainer"], "settings": dpo["dpo_settings"], "pairs": dpo["pairs"],
                            "train_loss": dpo["train_loss"], "first_step_loss": dpo["first_step_loss"],
                            "seconds": dpo["seconds"], "eval_curve": dpo["eval_curve"],
                            "train_loss_curve": [[point["step"], point["loss"]] for point in dpo["train_curve"]]}
        for stage in ("before", "after"):
            if stage in stages:
                entry[stage] = {"accuracy": accuracy(stages[stage]), "rows": stages[stage]["rows"],
                                "test_seconds": stages[stage]["test_seconds"]}
        if "before" in stages:
            page = paper_tasks_rows(found[method]["before"][0], stages["before"])
            if page is not None:
                entry["before"]["paper_tasks_rows_differing"] = paper_tasks_agreement(found[method]["before"][0],
                                                                                      stages["before"])
                # The retrained SFT adapter against the page's run of it: how far retraining moved the start.
                entry["before"]["paper_tasks_accuracy"] = accuracy({"rows": page})
                entry["before"]["minus_paper_tasks"] = paper_report.paired_bootstrap(
                    outcomes(stages["before"]), outcomes({"rows": page}))
        if "before" in stages and "after" in stages:
            if {t: len(r) for t, r in stages["before"]["rows"].items()} != {
                    t: len(r) for t, r in stages["after"]["rows"].items()}:
                raise SystemExit(f"{method}'s before and after records scored different test rows.")
            entry["after_minus_before"] = paper_report.paired_bootstrap(outcomes(stages["after"]),
                                                                        outcomes(stages["before"]))
        report["methods"][method] = entry
    tested = [entry[stage]["rows"] for entry in report["methods"].values() for stage in ("before", "after")
              if stage in entry]
    if tested:
        report["n_test"] = {task: len(rows) for task, rows in tested[0].items()}
    if (difference := gain_difference(report)) is not None:
        report["bitune_gain_minus_lora_gain"] = difference
    return report


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def _signed(value: float) -> str:
    return f"{100 * value:+.1f}"


def _interval(difference: dict) -> str:
    low, high = difference["ci95"]
    return f"{_signed(difference['mean'])} [{_signed(low)}, {_signed(high)}]"


def markdown(report: dict) -> str:
    """The page's generated block: which records exist, the test table, the reward curves."""
    lines = []
    if report["complete"]:
        lines.append("Every stage of both chains has its record.")
    else:
        missing = [f"{TITLES[method]} {STAGE_TITLES[stage]}" for method, stages in report["records"].items()
                   for stage, name in stages.items() if name is None]
        present = [f"{TITLES[method]} {STAGE_TITLES[stage]}" for method, stages in report["records"].items()
                   for stage, name in stages.items() if name is not None]
        lines.append(f"**Runs in progress.** Records present: {', '.join(present) or 'none'}. Not yet finished: "
                     f"{', '.join(missing)}. The numbers below are those of the records present.")
    lines.append("")
    tested = {method: entry for method, entry in report["methods"].items() if "before" in entry or "after" in entry}
    if tested:
        lines += ["| Task | test rows | " + " | ".join(
            f"{TITLES[m]} before | {TITLES[m]} after | {TITLES[m]} after − before [95% interval]" for m in tested)
                  + " |", "| --- | ---: |" + " ---: | ---: | ---: |" * len(tested)]
        for task in [*report["n_test"], "average"]:
            rows = sum(report["n_test"].values()) if task == "average" else report["n_test"][task]
            cells = []
            for entry in tested.values():
                for stage in ("before", "after"):
                    cells.append(_percent(entry[stage]["accuracy"][task]) if stage in entry else "—")
                if "after_minus_before" in entry:
                    difference = entry["after_minus_before"][task]
                    low, high = difference["ci95"]
                    cells.append(f"{_signed(difference['mean'])} [{_signed(low)}, {_signed(high)}]")
                else:
                    cells.append("—")
            name = TASK_TITLES[task]
            lines.append(f"| {'**' + name + '**' if task == 'average' else name} | {rows} | " + " | ".join(cells)
                         + " |")
        lines.append("")
    curves = {method: entry["dpo"] for method, entry in report["methods"].items() if "dpo" in entry}
    if curves:
        steps = sorted({point["step"] for dpo in curves.values() for point in dpo["eval_curve"]})
        pairs = {method: sum(task["held_out_pairs"] for task in dpo["pairs"].values()) for method, dpo in
                 curves.items()}
        lines += [f"Held-out pairs ({', '.join(f'{TITLES[m]}: {n}' for m, n in pairs.items())}), DPO's reward "
                  "accuracy (%) and mean margin (beta × the log-ratio difference, chosen − rejected):", "",
                  "| step | " + " | ".join(f"{TITLES[m]} reward accuracy | {TITLES[m]} margin" for m in curves)
                  + " |", "| ---: |" + " ---: | ---: |" * len(curves)]
        for step in steps:
            cells = []
            for dpo in curves.values():
                point = next((p for p in dpo["eval_curve"] if p["step"] == step), None)
                cells += ([_percent(point["reward_accuracy"]), f"{point['reward_margin']:.3f}"] if point
                          else ["—", "—"])
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("DPO training: " + "; ".join(
            f"{TITLES[m]} first-step loss {dpo['first_step_loss']:.4f} (ln 2 = 0.6931), mean loss over the run "
            f"{dpo['train_loss']:.4f}, {dpo['seconds'] / 60:.1f} min with its evaluations"
            for m, dpo in curves.items()) + ".")
        lines.append("")
    agreement = {method: entry["before"]["paper_tasks_rows_differing"] for method, entry in report["methods"].items()
                 if "paper_tasks_rows_differing" in entry.get("before", {})}
    if agreement:
        lines.append("Against the paper-tasks page's own test record of the same SFT run: " + "; ".join(
            f"{TITLES[m]} {n} of {sum(report['n_test'].values())} test rows differ" for m, n in agreement.items())
            + ".")
        lines.append("")
    if "bitune_gain_minus_lora_gain" in report:
        difference = report["bitune_gain_minus_lora_gain"]
        lines.append("Bitune's after − before minus LoRA's, paired over the same test rows [95% interval]: "
                     + "; ".join(f"{TASK_TITLES[task]} {_interval(difference[task])}"
                                 for task in [*report["n_test"], "average"]) + ".")
        lines.append("")
    moved = {method: entry["before"] for method, entry in report["methods"].items()
             if "minus_paper_tasks" in entry.get("before", {})}
    if moved:
        lines.append("The SFT adapter DPO starts from, retrained here, against the paper-tasks page's run of it (test "
                     "average, paired 95% interval): " + "; ".join(
                         f"{TITLES[m]} {_percent(before['paper_tasks_accuracy']['average'])} there, "
                         f"{_percent(before['accuracy']['average'])} here, "
                         f"{_interval(before['minus_paper_tasks']['average'])}" for m, before in moved.items()) + ".")
        lines.append("")
    sft = {method: entry["sft"] for method, entry in report["methods"].items() if "sft" in entry}
    if sft:
        lines.append("SFT (the page's recipe, seed 0): " + "; ".join(
            f"{TITLES[m]} ({s['paper_method']}, learning rate {s['learning_rate']:g}) mean training loss "
            f"{s['train_loss']:.4f}" + (f", the paper-tasks record's {s['paper_tasks_train_loss']:.4f}"
                                        if s["paper_tasks_train_loss"] is not None else "")
            for m, s in sft.items()) + ".")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_page(page: Path, block: str) -> None:
    text = page.read_text(encoding="utf-8")
    if PAGE_START not in text or PAGE_END not in text:
        raise SystemExit(f"{page} has no generated block: add the lines\n{PAGE_START}\n{PAGE_END}\nwhere it goes.")
    head, rest = text.split(PAGE_START, 1)
    _, tail = rest.split(PAGE_END, 1)
    page.write_text(f"{head}{PAGE_START}\n{block}{PAGE_END}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default=str(RECORDS), help="the folder of dpo.py's records")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--page", help="rewrite this page's generated block (between its markers)")
    parser.add_argument("--smoke", action="store_true", help="accept --smoke records (never for the docs)")
    args = parser.parse_args(argv)
    report = build(Path(args.records))
    if report["smoke"] and not args.smoke:
        raise SystemExit(f"{args.records} holds --smoke records: pass --smoke to report them (not for the docs).")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    block = markdown(report)
    if args.page:
        write_page(Path(args.page), block)
    print(block)
    return report


if __name__ == "__main__":
    main()

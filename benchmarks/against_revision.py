"""
This tree's Bitune against another revision's, side by side in one run: `benchmarks/run.py` in each, alternately.

    python benchmarks/against_revision.py --revision HEAD~3 --json docs/results/x.json -- --quick --model smollm2

Each round runs `run.py` (with the arguments after `--`) once in a checkout of `--revision` (a detached git worktree
in a temporary folder) and once in this tree, alternately, each in its own process with its own package on the path.
Within a run, every Bitune figure is already a ratio to plain LoRA timed in the same process (`suites.py`), and LoRA's
code is the same in both trees, so the ratio of the two trees' Bitune/LoRA ratios is the ratio of their Bitune times,
with whatever else the machine did in that round divided out. Reported per cell: each tree's ratios per round, their
medians, and this tree's median over the revision's (`this_over_revision`): under 1 is faster. For training cells
also `ratio_to_linear_flops` of each tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (report section, figure) pairs compared; each figure is a `measure.Ratio` dict of Bitune over LoRA.
FIGURES = (("train", "time"), ("generation", "prefill"), ("generation", "decode"))


def cell_name(section: str, cell: dict) -> str:
    if section == "train":
        return f"train b={cell['batch_size']} P={cell['prompt_length']} A={cell['answer_length']}"
    return f"generation b={cell['batch_size']} P={cell['prompt_length']}"


def run_once(tree: Path, run_args: list[str], out: Path) -> dict:
    """One `run.py` in `tree`, its own package first on the path; returns its JSON report."""
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, str(tree / "benchmarks" / "run.py"), *run_args, "--json", str(out)]
    finished = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True)
    if finished.returncode != 0:
        raise SystemExit(f"run.py failed in {tree}:\n{finished.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(rounds: dict[str, list[dict]]) -> dict:
    """Per cell and figure: each tree's Bitune/LoRA ratio per round, their medians, and this tree over the other."""
    cells = {}
    for section, figure in FIGURES:
        for index, cell in enumerate(rounds["this"][0][section]):
            ratios = {tree: [report[section][index][figure]["ratio"] for report in reports]
                      for tree, reports in rounds.items()}
            medians = {tree: statistics.median(values) for tree, values in ratios.items()}
            entry = {"ratios": ratios, "medians": medians,
                     "this_over_revision": medians["this"] / medians["revision"]}
            if section == "train":
                entry["ratio_to_linear_flops"] = {
                    tree: statistics.median(report[section][index]["ratio_to_linear_flops"] for report in reports)
                    for tree, reports in rounds.items()}
            cells[f"{cell_name(section, cell)}: {figure}"] = entry
    return cells


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    own, run_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="the git revision to compare this tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(own)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1.")
    if "--json" in run_args:
        parser.error("give --json before `--`: each run.py writes its own report into a temporary folder.")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist.")
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{args.revision}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        parser.error(f"--revision {args.revision!r} is not a commit of this repository.")
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "revision"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), commit.stdout.strip()], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            rounds: dict[str, list[dict]] = {"revision": [], "this": []}
            for number in range(args.rounds):
                for tree, path in (("revision", other), ("this", ROOT)):
                    rounds[tree].append(run_once(path, run_args, Path(scratch) / f"{tree}-{number}.json"))
                    print(f"round {number + 1}/{args.rounds}: {tree} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    this_head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"revision": commit.stdout.strip(), "this_tree_head": this_head, "run_args": run_args,
              "rounds": args.rounds, "cells": compare(rounds),
              "environment": rounds["this"][0].get("environment")}
    for name, entry in report["cells"].items():
        line = f"{name}: this / revision {entry['this_over_revision']:.3f} (Bitune/LoRA medians " \
               f"{entry['medians']['this']:.3f} here, {entry['medians']['revision']:.3f} there)"
        if "ratio_to_linear_flops" in entry:
            flops = entry["ratio_to_linear_flops"]
            line += f"; ratio_to_linear_flops {flops['this']:.3f} here, {flops['revision']:.3f} there"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

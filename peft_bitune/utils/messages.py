"""Pieces of error messages: which rows of a batch or data set, which position of a tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_true(mask: Any) -> tuple[int, int] | None:
    """The (row, column) of the first true entry of a 2-D boolean tensor, for an error message; `None` if none is."""
    found = mask.nonzero()
    return (int(found[0, 0]), int(found[0, 1])) if len(found) else None


def format_rows(rows: Sequence[int], most: int = 8) -> str:
    """Batch or dataset rows for an error message: `[0, 3, 5]`, or the first `most` then `...`."""
    shown = [str(row) for row in rows[:most]] + (["..."] if len(rows) > most else [])
    return "[" + ", ".join(shown) + "]"

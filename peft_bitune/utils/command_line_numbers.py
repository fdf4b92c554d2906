"""Numbers from a command line that parse but cannot be used, refused by the three commands before any work.

`float("nan")`, `float("inf")` and `float("1e999")` (which overflows to inf) are floats, and Python's integers have no
bound, so argparse accepts them all; each then fails deep inside a run (`int(nan)`, a product that overflows, a seed
numpy refuses) with a traceback. `bitune-serve`, `bitune-sft` and `bitune-eval` check their numeric flags with
`number_problem` and refuse with one line that names the flag.
"""

from __future__ import annotations

import math
from typing import Any

INT64_RANGE = (-(2**63), 2**63 - 1)


def number_problem(value: Any) -> str | None:
    """Why a parsed number cannot be used (not finite, or an integer beyond 64 bits), or None (also for non-numbers,
    which their own checks handle). A list is checked item by item."""
    if isinstance(value, (list, tuple)):
        return next((problem for item in value if (problem := number_problem(item))), None)
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value} (nan, inf and floats beyond range, e.g. 1e999, are not)"
    if isinstance(value, int) and not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        return f"must fit in 64 bits (between -2^63 and 2^63 - 1), got {value}"
    return None

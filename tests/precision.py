"""Tolerances for results computed in reduced precision, grounded in the dtype's rounding and the values' size.

Two computations of the same thing in bf16 (batched and row by row, or on two CPUs whose kernels sum in another
order) differ when the float32 inputs of a bf16 rounding differ in their last bits: the rounding then lands on the
neighbouring bf16 value, a relative change of up to 2**-8 (bf16 keeps 8 significant bits) of that element. Each such
change reaches a result through sums over many elements, so what a result may differ by scales with the size of the
values it is made of, not with the result itself: an element near zero carries the absolute error of the large ones.
Hence `atol = roundings * unit_roundoff * max|expected|` for every element (a relative tolerance would add nothing:
no element is larger than the largest).

A fixed absolute tolerance is only right in float32, where the differences are a few units in the 24th bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Half the distance from 1 to the next value: the largest relative change of one rounding to nearest.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass(frozen=True)
class Tolerance:
    """How close a result must be to the expected one: `atol + of_largest * scale` for every element, where `scale` is
    the largest magnitude of the expected values unless given."""

    atol: float = 0.0
    of_largest: float = 0.0

    def assert_close(self, actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None, msg=None) -> None:
        if scale is None:
            scale = float(expected.detach().abs().max())
        torch.testing.assert_close(actual, expected, atol=self.atol + self.of_largest * scale, rtol=0, msg=msg)


def float32_sums(atol: float) -> Tolerance:
    """Both sides compute in float32 and differ only in the order of their sums: a fixed `atol`."""
    return Tolerance(atol=atol)


def roundings(dtype: torch.dtype, count: float) -> Tolerance:
    """`count` roundings to `dtype` of the largest expected value, for every element."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"`dtype` must be one of {list(UNIT_ROUNDOFF)}, got {dtype}.")
    return Tolerance(of_largest=count * UNIT_ROUNDOFF[dtype])


def assert_same_greedy_tokens_up_to_a_tie(
    tokens: list[int], scores: list[torch.Tensor], expected_tokens: list[int], expected_scores: list[torch.Tensor],
    tolerance: Tolerance,
) -> None:
    """Greedy tokens and the scores (vocab,) they were chosen from, step by step, against the expected ones.

    The scores must agree within `tolerance`, and so the tokens, except where the expected best two scores are
    closer than the tolerance: a tie within rounding, which two correct runs may break differently. The comparison
    ends at such a step (the runs go on from different tokens).
    """
    assert len(tokens) == len(expected_tokens) == len(scores) == len(expected_scores)
    for step, (token, expected_token) in enumerate(zip(tokens, expected_tokens)):
        tolerance.assert_close(scores[step], expected_scores[step], msg=f"scores at step {step}")
        if token != expected_token:
            gap = float(expected_scores[step][expected_token] - expected_scores[step][token])
            allowed = tolerance.atol + tolerance.of_largest * float(expected_scores[step].abs().max())
            assert gap <= allowed, (
                f"step {step}: token {token} instead of {expected_token}, whose score is {gap:.3g} higher (a tie is "
                f"within {allowed:.3g})"
            )
            return

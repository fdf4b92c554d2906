"""Finding the Bitune tuner in whatever model a caller was given: a Bitune `PeftModel`, the tuner itself, or a model
wrapped by DDP, FSDP or accelerate; and refusing, in one wording, a model that holds none."""

from __future__ import annotations

from typing import Any

from peft import PeftModel
from torch import nn

from .model import BituneModel


def find_bitune_tuner(model: nn.Module) -> BituneModel | None:
    """The `BituneModel` of `model`: the tuner itself, the one inside a Bitune `PeftModel`, or the one inside a model
    wrapped by DDP, FSDP or accelerate. `None` if there is none (`require_bitune_tuner` refuses that instead)."""
    if isinstance(model, BituneModel):
        return model
    base_model = getattr(model, "base_model", None)
    if isinstance(base_model, BituneModel):
        return base_model
    return next((module for module in model.modules() if isinstance(module, BituneModel)), None)


class NotABituneModelError(TypeError, ValueError):
    """A model without a Bitune adapter where one is needed. A `TypeError` (the argument is of the wrong kind) and a
    `ValueError` (as PEFT's own refusals of a model), so that code catching either one catches it."""


def require_bitune_tuner(model: Any, needed_for: str, otherwise: str = "") -> BituneModel:
    """
    The `BituneModel` of `model` (see `find_bitune_tuner`); refuses a model without one, saying what it was
    `needed_for` ("to draw its attention maps"), what was given, and what to do `otherwise`.
    """
    tuner = find_bitune_tuner(model) if isinstance(model, nn.Module) else None
    if tuner is not None:
        return tuner
    inner = model.base_model if isinstance(model, PeftModel) else None
    given = type(model).__name__ + (f" with a {type(inner).__name__}" if inner is not None else "")
    raise NotABituneModelError(
        f"Expected a Bitune model {needed_for} (a `PeftModel` with a Bitune adapter, made with a `BituneConfig`, or "
        f"its `BituneModel`), got a {given}, which holds none. {otherwise}".rstrip()
    )

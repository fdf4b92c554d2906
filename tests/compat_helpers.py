"""Test tools for the transformers renames: a model that accepts only the new `cache` name (what transformers 5.40 does
to every forward, and 6.0 to `generate`), and a record of the deprecation warnings the project's own calls cause."""

from __future__ import annotations

import inspect
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from transformers import LlamaModel

from peft_bitune import compat

needs_cache_name = pytest.mark.skipif(  # decided without `compat`, which the tests check
    "cache" not in inspect.signature(LlamaModel.forward).parameters,
    reason="transformers < 5.24 has no `cache` name for `past_key_values` to be removed in favour of",
)

# The renamed names whose deprecation notices the project must not cause.
RENAMED = ("past_key_values", "cache_params", "gradient_checkpointing")


def _deprecates_past_key_values(function: Any) -> bool:
    """Whether transformers' `deprecate_kwarg("past_key_values", ...)` wraps `function`, at any depth."""
    while function is not None:
        names = function.__code__.co_freevars if hasattr(function, "__code__") else ()
        cells = dict(zip(names, function.__closure__ or ()))
        if "old_name" in cells and cells["old_name"].cell_contents == compat.OLD_CACHE_NAME:
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _refusing_past_key_values(module: Any, function: Any) -> Any:
    """`function` bound to `module`, refusing `past_key_values` before any deprecation wrapper could map it."""

    @wraps(function)
    def only_cache(*args: Any, **kwargs: Any) -> Any:
        if compat.OLD_CACHE_NAME in kwargs:
            raise TypeError(
                f"{type(module).__name__}.{function.__name__}() got an unexpected keyword argument 'past_key_values' "
                "(removed in transformers 5.40; `cache` is the name)"
            )
        return function(module, *args, **kwargs)

    return only_cache


@contextmanager
def only_cache_argument(model: nn.Module) -> Iterator[int]:
    """
    Within the block, the forwards of `model` and of its sub-models, and its `generate`, refuse `past_key_values`, as
    if the deprecation wrappers that map it to `cache` were gone (transformers 5.40 for forwards, 6.0 for `generate`;
    there the old name will land, ignored, in `**kwargs`: refusing it makes the test say which call used it).

    Only these instances change (their bound methods are replaced, then removed again); yields how many methods were
    replaced, so that a test can check that it really simulated something.
    """
    replaced = []
    for module in model.modules():
        for name in ("forward", "generate"):
            function = getattr(type(module), name, None)
            if function is not None and _deprecates_past_key_values(function) and name not in vars(module):
                setattr(module, name, _refusing_past_key_values(module, function))
                replaced.append((module, name))
    try:
        yield len(replaced)
    finally:
        for module, name in replaced:
            delattr(module, name)


def _package_dir(name: str) -> str:
    return str(Path(__import__(name).__file__).parent)


# Libraries whose warnings name the caller: a warning raised under them is about whoever called them.
_CALLED = tuple(_package_dir(name) for name in ("torch", "transformers", "accelerate")) + (
    str(Path(warnings.__file__).parent),  # the standard library (functools, contextlib, warnings)
)
# Libraries whose own calls are theirs, not the project's.
_THIRD_PARTY = tuple(_package_dir(name) for name in ("peft", "trl"))


def _caller(stack: list[traceback.FrameSummary]) -> str:
    """The file of the innermost frame outside transformers, accelerate, torch and the standard library: whose call
    the library under it warns about."""
    for frame in reversed(stack):
        if not frame.filename.startswith(_CALLED) and not frame.filename.startswith("<"):
            return frame.filename
    return "<unknown>"


@contextmanager
def renamed_name_warnings() -> Iterator[list[tuple[str, str]]]:
    """
    Record the FutureWarnings about the renamed names (`past_key_values`, `gradient_checkpointing*`) raised within the
    block, as `(message, caller file)`, where the caller is whoever called into transformers (see `_caller`).
    """
    recorded: list[tuple[str, str]] = []

    def record(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if issubclass(category, FutureWarning) and any(name in text for name in RENAMED):
            recorded.append((text, _caller(traceback.extract_stack()[:-1])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # called inside `warnings.warn`, so the stack is the warning's
        yield recorded


def from_project(recorded: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The recorded warnings that are not PEFT's or TRL's own (their calls are theirs; docs/faq.md lists them)."""
    return [(text, caller) for text, caller in recorded if not caller.startswith(_THIRD_PARTY)]

"""
The names that differ between the transformers releases peft-bitune supports, decided here and nowhere else.

- transformers 5.24 renamed the KV cache argument of model forwards and of `generate` from `past_key_values` to
  `cache` (the old name goes away in 5.40 for forwards, in 6.0 for `generate`), and the outputs' `past_key_values`
  attribute to `cache`. Older releases know only `past_key_values`.
- transformers 5.23 renamed gradient checkpointing to activation checkpointing: the `TrainingArguments`
  `gradient_checkpointing` (and `_kwargs`) and `gradient_checkpointing_enable` became `activation_checkpointing*` (the
  old names go away in 6.0).

Every call the project makes with one of these names goes through this module, so that it uses the current name where
the installed transformers has it, and the old one on older releases. (A later clean-up gathers the project's other
uses of private transformers and PEFT interfaces here too.)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from transformers import PreTrainedModel, TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

OLD_CACHE_NAME = "past_key_values"
NEW_CACHE_NAME = "cache"

# The name this transformers release uses for the KV cache: outputs carry it as a field, `generate` takes it.
_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
CACHE_NAME = NEW_CACHE_NAME if NEW_CACHE_NAME in _OUTPUT_FIELDS else OLD_CACHE_NAME

_TRAINING_ARGUMENTS = {f.name for f in dataclasses.fields(TrainingArguments)}
# `TrainingArguments` switch for activation (gradient) checkpointing and its kwargs, as this release names them.
CHECKPOINTING_ARGUMENT = (
    "activation_checkpointing" if "activation_checkpointing" in _TRAINING_ARGUMENTS else "gradient_checkpointing"
)
CHECKPOINTING_KWARGS_ARGUMENT = f"{CHECKPOINTING_ARGUMENT}_kwargs"
# Both names of each, current first: on releases with the new names, the old ones are mirrored aliases.
CHECKPOINTING_ARGUMENTS = tuple(
    name for name in ("activation_checkpointing", "gradient_checkpointing") if name in _TRAINING_ARGUMENTS
)
CHECKPOINTING_KWARGS_ARGUMENTS = tuple(f"{name}_kwargs" for name in CHECKPOINTING_ARGUMENTS)
# The model method that turns it on, and its keyword for the checkpoint kwargs.
CHECKPOINTING_ENABLE = (
    "activation_checkpointing_enable"
    if hasattr(PreTrainedModel, "activation_checkpointing_enable")
    else "gradient_checkpointing_enable"
)
CHECKPOINTING_ENABLE_KWARGS = CHECKPOINTING_ENABLE.replace("_enable", "_kwargs")


def cache_argument(model: Any) -> str:
    """The name under which `model`'s forward takes a KV cache: the one its signature has (`cache` or
    `past_key_values`), so that a model written for another release (remote code) gets the name it knows; the
    release's name otherwise."""
    return _cache_name_of(type(model))


@functools.cache
def _cache_name_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters  # follows the deprecation wrappers' `__wrapped__`
    for name in (NEW_CACHE_NAME, OLD_CACHE_NAME):
        if name in parameters:
            return name
    return CACHE_NAME


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to `model`'s forward: `model(**with_cache(model, cache), ...)`."""
    return {cache_argument(model): cache}


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """
    Take the KV cache out of the keyword arguments a user gave to a Bitune `forward` or `generate`, under either name
    (`cache`, or `past_key_values` as before transformers 5.24), whatever the installed release calls it.

    Raises `ValueError` if both names are given (which one was meant is not ours to guess).
    """
    if kwargs.get(NEW_CACHE_NAME) is not None and kwargs.get(OLD_CACHE_NAME) is not None:
        raise ValueError(
            f"Pass the KV cache once: as `{CACHE_NAME}` (`past_key_values` is its old name), not under both names."
        )
    new, old = kwargs.pop(NEW_CACHE_NAME, None), kwargs.pop(OLD_CACHE_NAME, None)
    return new if new is not None else old


def output_cache(output: Any) -> Any:
    """The KV cache an output carries (`output.cache`, or `output.past_key_values` before transformers 5.24), read
    without the deprecation notice of the old attribute."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    return getattr(output, NEW_CACHE_NAME if NEW_CACHE_NAME in fields else OLD_CACHE_NAME)


def enable_checkpointing(model: Any, **checkpoint_kwargs: Any) -> None:
    """Turn on activation (gradient) checkpointing of `model` under the release's method name; `checkpoint_kwargs` go
    to `torch.utils.checkpoint.checkpoint` (e.g. `use_reentrant=False`)."""
    getattr(model, CHECKPOINTING_ENABLE)(**{CHECKPOINTING_ENABLE_KWARGS: checkpoint_kwargs or None})


def checkpointing_hint() -> str:
    """How to turn on the non-reentrant checkpointing Bitune needs, in this release's names."""
    return f"`model.{CHECKPOINTING_ENABLE}({CHECKPOINTING_ENABLE_KWARGS}={{'use_reentrant': False}})`"

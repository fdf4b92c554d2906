"""Refuse pickled saves of a Bitune `PeftModel` before PEFT writes anything.

peft-bitune never reads `adapter_model.bin` (a pickle), so `save_pretrained(safe_serialization=False)` is refused. The
refusal must come first: `PeftModel.save_pretrained` creates the folder and its README.md, then writes the weights, and
only then the config (where `BituneConfig.save_pretrained` could object), and PEFT calls no tuner code that sees the
argument in between. PEFT has no per-method `PeftModel` class either, so each `PeftModel` that wraps a `BituneModel`
gets its own `save_pretrained`, which checks the arguments and the target folders and then calls PEFT's. It is set
when the `BituneModel` is attached to the `PeftModel`, through torch's module-registration hook (its public extension
point for this); PEFT's class and other models are untouched.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch
from peft import PeftModel
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
from torch import nn

from .hub import refuse_pickled_weights_in
from .model import BituneModel

_registration_hook: Any = None


def guard_bitune_saving() -> None:
    """Install the module-registration hook that guards the saving of Bitune `PeftModel`s. Safe to call more than
    once."""
    global _registration_hook
    if _registration_hook is None:
        _registration_hook = torch.nn.modules.module.register_module_module_registration_hook(_on_module_registration)


def _on_module_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if name != "base_model":  # runs for every submodule registered anywhere: the cheap test first
        return
    if isinstance(submodule, BituneModel) and isinstance(module, PeftModel):
        # An instance attribute: it shadows PEFT's method for this model only, and survives copy.deepcopy and pickling.
        module.__dict__["save_pretrained"] = functools.partial(save_pretrained_safetensors_only, module)


def save_pretrained_safetensors_only(model: nn.Module, save_directory: str, *args: Any, **kwargs: Any) -> None:
    """`PeftModel.save_pretrained`, refusing before anything is written a pickled save or a target folder that holds an
    `adapter_model.bin` (which `PeftModel.from_pretrained` would not use, but peft-bitune refuses to sit next to)."""
    save = type(model).save_pretrained
    arguments = inspect.signature(save).bind(model, save_directory, *args, **kwargs)
    arguments.apply_defaults()
    if arguments.arguments.get("safe_serialization") is False:
        raise ValueError(
            f"`save_pretrained(safe_serialization=False)` would write {WEIGHTS_NAME}, a pickle, which peft-bitune "
            f"never reads. Bitune adapters are saved as {SAFETENSORS_WEIGHTS_NAME} only: save without "
            "`safe_serialization=False`. Nothing was written."
        )
    selected = arguments.arguments.get("selected_adapters") or list(model.peft_config)
    for adapter_name in selected:
        folder = save_directory if adapter_name == "default" else os.path.join(save_directory, adapter_name)
        refuse_pickled_weights_in(folder, "Nothing was written.")
    return save(*arguments.args, **arguments.kwargs)

"""
Bitune adapters are safetensors only: a pickle (`adapter_model.bin`) is never written and never read. Every refusal
of one is here, and every refusal of a weights file PEFT could not read.

- Reading: `BituneConfig.from_pretrained`, which PEFT calls before it adds the adapter to the model and reads any
  weights, refuses an adapter whose weights exist only as a pickle, in a folder or in a Hub repo, an adapter without
  weights, and, in a folder, a weights file that is a dangling link, a folder, or not a complete safetensors file
  (`check_adapter_weights`). Refused there, the adapter is never added: PEFT adds it before it reads the weights, and
  a read that fails leaves it behind.
- Writing: a Bitune `PeftModel`'s `save_pretrained` refuses `safe_serialization=False` and a target folder that holds
  a pickle, before anything is written (`save_pretrained_safetensors_only`); `BituneConfig.save_pretrained` refuses to
  finish next to a pickle, as a second line (`refuse_pickled_weights_in`).

Why writing needs a module-registration hook. PEFT 0.21's `PeftModel.save_pretrained(save_directory,
safe_serialization, ...)` creates the folder and writes its README.md (`create_or_update_model_card`), then for each
adapter collects the weights (`get_peft_model_state_dict`, which calls the tuner's `_get_adapter_state_dict` with the
model and the state dict only), writes them (`torch.save`, the pickle, when `safe_serialization=False`), and only then
calls the config's `save_pretrained(output_dir)`. No code of the tuner or of its config sees `safe_serialization`
before the pickle is written. `PeftModel` has no per-method subclass either: `get_peft_model` and
`PeftModel.from_pretrained` pick the class by task type. So the check has to sit on the `PeftModel` instance, as its
own `save_pretrained`, and Bitune's code never holds that instance: PEFT builds the tuner inside `PeftModel.__init__`
and assigns it to `self.base_model`. torch's module-registration hook, its public extension point for "a module is
being assigned to another", is the one place that sees the two together.

Its reach is kept to that one assignment: each `BituneModel` registers a hook when it is built
(`watch_for_peft_model`), which acts only when that very tuner is assigned as the `base_model` of a `PeftModel`, and
PEFT's next call on the tuner in `PeftModel.__init__` (`_cast_adapter_dtype`) removes it (`stop_watching`). Nothing
is registered on import, other models and PEFT's class are untouched, and the hook of a tuner that is never attached
does nothing once that tuner is gone, and is removed when the next `BituneModel` is built.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from typing import Any, NoReturn

import huggingface_hub
import torch
from huggingface_hub import file_exists, try_to_load_from_cache
from peft import PeftModel
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.utils.hooks import RemovableHandle

# The registration hooks of the tuners built but not yet attached to a `PeftModel`, by `id` of the tuner.
_watching: dict[int, tuple[weakref.ref, RemovableHandle]] = {}


# ------------------------------------------------------------------------------------------------------------ writing
def watch_for_peft_model(tuner: nn.Module) -> None:
    """Give the `PeftModel` that `tuner` will be attached to (as its `base_model`) a `save_pretrained` that refuses
    pickles; see the module docstring. Called when a `BituneModel` is built."""
    for key, (watched, watching) in list(_watching.items()):
        if watched() is None:  # a tuner that was never attached, and is gone
            watching.remove()
            del _watching[key]
    stop_watching(tuner)
    tuner_ref = weakref.ref(tuner)

    def on_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        attached = name == "base_model" and submodule is not None and submodule is tuner_ref()
        if attached and isinstance(module, PeftModel):
            # An instance attribute: it shadows PEFT's method for this model only, and survives deepcopy and pickling.
            module.__dict__["save_pretrained"] = functools.partial(save_pretrained_safetensors_only, module)

    handle = torch.nn.modules.module.register_module_module_registration_hook(on_registration)
    _watching[id(tuner)] = (tuner_ref, handle)


def stop_watching(tuner: nn.Module) -> None:
    """Remove `tuner`'s registration hook, if it has one. Never called from within a registration hook: torch iterates
    over its hooks while it calls them."""
    entry = _watching.pop(id(tuner), None)
    if entry is not None:
        entry[1].remove()


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


def refuse_pickled_weights_in(folder: str, not_done: str) -> None:
    """Refuse to save into a folder that holds `adapter_model.bin` (a pickle), which peft-bitune never reads; the
    error ends with `not_done`, what was therefore not written."""
    if os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        raise ValueError(
            f"'{folder}' holds {WEIGHTS_NAME} (a pickle, e.g. from an earlier `save_pretrained(..., "
            f"safe_serialization=False)`), which peft-bitune never reads. Bitune adapters are saved as "
            f"{SAFETENSORS_WEIGHTS_NAME} only: delete {WEIGHTS_NAME}, or save into another folder. {not_done}"
        )


# ------------------------------------------------------------------------------------------------------------ reading
def check_adapter_weights(model_id: str, subfolder: str | None = None, **hub_kwargs: Any) -> None:
    """
    Refuse, naming the file and what is wrong with it, adapter weights that PEFT must not read (a pickle) or cannot
    read: no weights file; in a local folder also a weights path that is a dangling link or a folder, or a file that is
    not a complete safetensors file (truncated, empty or damaged by an interrupted save, copy or download).

    Called by `BituneConfig.from_pretrained`, which both of PEFT's loaders (`PeftModel.from_pretrained`,
    `load_adapter`) call before they add the adapter to the model: PEFT adds it, then reads the weights, and a failed
    read leaves it behind, randomly initialised, with a message that names no file. A Hub repo is checked for the
    presence of the file only (its content is read when PEFT downloads it).
    """
    folder = os.path.join(model_id, subfolder) if subfolder else model_id
    if os.path.isdir(folder):
        _check_local_weights(folder)
        return
    if _in_repo(model_id, subfolder, SAFETENSORS_WEIGHTS_NAME, hub_kwargs):
        return
    if _in_repo(model_id, subfolder, WEIGHTS_NAME, hub_kwargs):
        _refuse_pickle_only(model_id)
    offline = huggingface_hub.constants.HF_HUB_OFFLINE or hub_kwargs.get("local_files_only")
    where = "the local Hugging Face cache (offline) holds" if offline else "the Hub repo holds"
    revision = f" at revision `{hub_kwargs['revision']}`" if hub_kwargs.get("revision") else ""
    raise ValueError(
        f"Cannot load the Bitune adapter '{model_id}': {where} its config but no "
        f"{_named(subfolder, SAFETENSORS_WEIGHTS_NAME)}{revision}. Nothing was loaded. Check the repo id, revision "
        "and subfolder" + (", or download the adapter while online." if offline else ".")
    )


def has_only_pickled_weights(model_id: str, subfolder: str | None = None, **hub_kwargs: Any) -> bool:
    """
    Whether PEFT would read `adapter_model.bin` (a pickle) for this adapter because there is no
    `adapter_model.safetensors`: in the local folder, or in the Hub repo (its local cache when offline).
    """
    folder = os.path.join(model_id, subfolder) if subfolder else model_id
    if os.path.isdir(folder):
        return not os.path.exists(os.path.join(folder, SAFETENSORS_WEIGHTS_NAME)) and os.path.isfile(
            os.path.join(folder, WEIGHTS_NAME)
        )
    in_repo = functools.partial(_in_repo, model_id, subfolder, hub_kwargs=hub_kwargs)
    return not in_repo(SAFETENSORS_WEIGHTS_NAME) and in_repo(WEIGHTS_NAME)


def safetensors_problem(path: str) -> str | None:
    """Why `path` is not a complete safetensors file (safetensors' own words), or `None` if it is one. Reads the header
    only: safetensors checks that the header is valid JSON and that its tensors cover the file exactly."""
    try:
        with safe_open(path, framework="pt"):
            return None
    except (SafetensorError, OSError) as error:
        return str(error)


def _check_local_weights(folder: str) -> None:
    path = os.path.join(folder, SAFETENSORS_WEIGHTS_NAME)
    cannot = f"Cannot load the Bitune adapter at '{folder}'"
    again = "Save (or download) the adapter again, or copy the whole folder again. Nothing was loaded."
    if not os.path.lexists(path):
        if os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
            _refuse_pickle_only(folder)
        raise ValueError(
            f"{cannot}: it has no {SAFETENSORS_WEIGHTS_NAME}, only its config (a save, copy or download that stopped "
            f"early, or only the config was copied). {again}"
        )
    if not os.path.exists(path):
        raise ValueError(
            f"{cannot}: '{path}' is a symbolic link to '{os.readlink(path)}', which does not exist (a moved or "
            f"deleted file, or a Hugging Face cache whose files were removed). {again}"
        )
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise ValueError(f"{cannot}: '{path}' is {kind}; it must be the adapter's weights file. {again}")
    problem = safetensors_problem(path)
    if problem is not None:
        raise ValueError(
            f"{cannot}: '{path}' is not a complete safetensors file ({problem}); it is truncated, empty or damaged, "
            f"e.g. by an interrupted save, copy or download. {again}"
        )


def _refuse_pickle_only(model_id: str) -> NoReturn:
    raise ValueError(
        f"The Bitune adapter at '{model_id}' has its weights only as {WEIGHTS_NAME}, a pickle, which peft-bitune "
        f"never reads. Convert it to {SAFETENSORS_WEIGHTS_NAME} where you trust the file "
        "(`safetensors.torch.save_file(torch.load(path, weights_only=True), new_path)`), or save the adapter "
        "again with `save_pretrained` (safetensors by default)."
    )


def _named(subfolder: str | None, name: str) -> str:
    return f"{subfolder}/{name}" if subfolder else name


def _in_repo(model_id: str, subfolder: str | None, name: str, hub_kwargs: dict[str, Any]) -> bool:
    """Whether the Hub repo holds `name` (in `subfolder`): asked of the Hub, or of its local cache when offline."""
    filename = _named(subfolder, name)
    revision, repo_type = hub_kwargs.get("revision"), hub_kwargs.get("repo_type")
    if huggingface_hub.constants.HF_HUB_OFFLINE or hub_kwargs.get("local_files_only"):
        cached = try_to_load_from_cache(
            model_id, filename, cache_dir=hub_kwargs.get("cache_dir"), revision=revision, repo_type=repo_type
        )
        return isinstance(cached, str)
    return file_exists(model_id, filename, revision=revision, repo_type=repo_type, token=hub_kwargs.get("token"))

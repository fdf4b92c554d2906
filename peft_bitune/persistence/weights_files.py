"""
The weights file a Bitune adapter is loaded from, and every refusal of one that PEFT could not read or must not read,
made before PEFT adds the adapter to a model.

Saving is PEFT's own, and `save_pretrained(safe_serialization=False)` is not refused: it writes `adapter_model.bin`
(a pickle, by `torch.save`) as PEFT writes it, and that loads back with every weight of the adapter (both weight sets
and the mixing scalars), as `adapter_model.safetensors`, the default, does. PEFT calls no code of the tuner or of its
config before it writes the weights: a refusal before anything is written would need a process-wide hook (torch's
module-registration hook, to reach the `PeftModel`), which peft-bitune does not install, and a refusal afterwards
would leave a half-saved folder. When a folder holds both files, PEFT loads `adapter_model.safetensors`:
`BituneConfig.save_pretrained` warns that the other one is ignored (`warn_if_two_weights_files`).

Loading: `BituneConfig.from_pretrained`, which PEFT calls before it adds the adapter to the model and reads any
weights, refuses an adapter without weights, and a weights file (in a local folder or a Hub repo) that is a dangling
link, a folder, not a complete safetensors file, or a pickle that PEFT's loader would refuse or fail on
(`check_adapter_weights`).
PEFT reads a pickle with `torch.load(weights_only=True)`, whose unpickler builds only tensors and plain containers and
refuses anything else (a pickle that would run code) without running it. The check reads it the same way, first,
because PEFT reads the weights only after it has added the adapter, and a read that fails leaves the adapter behind,
randomly initialised. From a Hub repo, the file PEFT will read is downloaded first (into the Hugging Face cache, where
PEFT then finds it; offline, the cached copy is read) and checked the same way.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import huggingface_hub
import torch
from huggingface_hub import file_exists, hf_hub_download, try_to_load_from_cache
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
from safetensors import SafetensorError, safe_open


# ------------------------------------------------------------------------------------------------------------ writing
def warn_if_two_weights_files(folder: str) -> None:
    """Warn when `folder` holds both weights files (a save with the other `safe_serialization` into a folder that
    already held one): PEFT loads `adapter_model.safetensors` and ignores `adapter_model.bin`, the newer or not."""
    if os.path.isfile(os.path.join(folder, SAFETENSORS_WEIGHTS_NAME)) and os.path.isfile(
        os.path.join(folder, WEIGHTS_NAME)
    ):
        warnings.warn(
            f"'{folder}' holds both {SAFETENSORS_WEIGHTS_NAME} and {WEIGHTS_NAME} (one is left from an earlier save "
            f"with the other `safe_serialization`). Loading the adapter reads {SAFETENSORS_WEIGHTS_NAME} and ignores "
            f"{WEIGHTS_NAME}, even if that is the newer one: delete the file of the earlier save, or save into an "
            "empty folder.",
            UserWarning,
            stacklevel=3,
        )


# ------------------------------------------------------------------------------------------------------------ reading
def check_adapter_weights(model_id: str, subfolder: str | None = None, **hub_kwargs: Any) -> None:
    """
    Refuse, naming the file and what is wrong with it, adapter weights that PEFT cannot read or must not read: no
    weights file; in a local folder also a weights path that is a dangling link or a folder, a file that is not a
    complete safetensors file (truncated, empty or damaged by an interrupted save, copy or download), and a pickle
    that `torch.load(weights_only=True)` refuses (one that would run code) or cannot read.

    Called by `BituneConfig.from_pretrained`, which both of PEFT's loaders (`PeftModel.from_pretrained`,
    `load_adapter`) call before they add the adapter to the model: PEFT adds it, then reads the weights, and a failed
    read leaves it behind, randomly initialised, with a message that names no file. From a Hub repo, the file PEFT
    will read is downloaded into the Hugging Face cache first (PEFT then finds it there) and checked the same way.
    """
    folder = os.path.join(model_id, subfolder) if subfolder else model_id
    if os.path.isdir(folder):
        _check_local_weights(folder)
        return
    if subfolder and huggingface_hub.constants.HF_HUB_OFFLINE:
        subfolder = _offline_subfolder(model_id, subfolder, hub_kwargs)
    for name in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME):  # the file PEFT reads: safetensors if the repo has it
        if _in_repo(model_id, subfolder, name, hub_kwargs):
            _check_weights_file(
                _hub_file(model_id, subfolder, name, hub_kwargs),
                f"Cannot load the Bitune adapter '{model_id}'",
                "Download the adapter again (remove it from the Hugging Face cache first). Nothing was loaded.",
            )
            return
    offline = huggingface_hub.constants.HF_HUB_OFFLINE or hub_kwargs.get("local_files_only")
    where = "the local Hugging Face cache (offline) holds" if offline else "the Hub repo holds"
    revision = f" at revision `{hub_kwargs['revision']}`" if hub_kwargs.get("revision") else ""
    raise ValueError(
        f"Cannot load the Bitune adapter '{model_id}': {where} its config but no "
        f"{_named(subfolder, SAFETENSORS_WEIGHTS_NAME)} (nor {_named(subfolder, WEIGHTS_NAME)}){revision}. Nothing "
        "was loaded. Check the repo id, revision and subfolder"
        + (", or download the adapter while online." if offline else ".")
    )


def _offline_subfolder(model_id: str, subfolder: str, hub_kwargs: dict[str, Any]) -> str:
    """
    The folder of a Hub repo in which PEFT's loader looks for the weights offline: it names the file with the
    subfolder and passes the subfolder as well (peft 0.21), so it looks in `<subfolder>/<subfolder>`. Where the cache
    holds no weights there, PEFT would fail after adding the adapter: refused here, before, with the way round it.
    """
    doubled = f"{subfolder}/{subfolder}"
    if any(_in_repo(model_id, doubled, name, hub_kwargs) for name in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)):
        return doubled
    raise ValueError(
        f"Cannot load the Bitune adapter '{model_id}' from its subfolder '{subfolder}' offline: PEFT's loader looks "
        f"for the weights offline at '{doubled}/{SAFETENSORS_WEIGHTS_NAME}' (the subfolder named twice), which the "
        "Hugging Face cache does not hold, and would fail after adding the adapter. Nothing was loaded. Load the "
        f"cached snapshot by its path instead: `load_adapter(huggingface_hub.snapshot_download({model_id!r}, "
        f"local_files_only=True), subfolder={subfolder!r}, ...)` (the same for `PeftModel.from_pretrained`), or "
        "load it online."
    )


def safetensors_problem(path: str) -> str | None:
    """Why `path` is not a complete safetensors file (safetensors' own words), or `None` if it is one. Reads the header
    only: safetensors checks that the header is valid JSON and that its tensors cover the file exactly."""
    try:
        with safe_open(path, framework="pt"):
            return None
    except (SafetensorError, OSError) as error:
        return str(error)


def _check_local_weights(folder: str) -> None:
    """The checks of the file PEFT will read: `adapter_model.safetensors` if there is one (also a broken one, which
    PEFT would pass over for a pickle next to it), else `adapter_model.bin`."""
    safetensors, pickled = os.path.join(folder, SAFETENSORS_WEIGHTS_NAME), os.path.join(folder, WEIGHTS_NAME)
    path = pickled if os.path.lexists(pickled) and not os.path.lexists(safetensors) else safetensors
    cannot = f"Cannot load the Bitune adapter at '{folder}'"
    again = "Save (or download) the adapter again, or copy the whole folder again. Nothing was loaded."
    if not os.path.lexists(path):
        raise ValueError(
            f"{cannot}: it has no {SAFETENSORS_WEIGHTS_NAME} (nor {WEIGHTS_NAME}), only its config (a save, copy or "
            f"download that stopped early, or only the config was copied). {again}"
        )
    _check_weights_file(path, cannot, again)


def _check_weights_file(path: str, cannot: str, again: str) -> None:
    """The checks of a weights file that is there (in a folder, or in the Hugging Face cache): not a dangling link,
    a regular file, and readable as PEFT reads it (a pickle by its extension, else safetensors)."""
    if not os.path.exists(path):
        raise ValueError(
            f"{cannot}: '{path}' is a symbolic link to '{os.readlink(path)}', which does not exist (a moved or "
            f"deleted file, or a Hugging Face cache whose files were removed). {again}"
        )
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise ValueError(f"{cannot}: '{path}' is {kind}; it must be the adapter's weights file. {again}")
    if os.path.basename(path) == WEIGHTS_NAME:
        _check_pickle(path, cannot, again)
        return
    problem = safetensors_problem(path)
    if problem is not None:
        raise ValueError(
            f"{cannot}: '{path}' is not a complete safetensors file ({problem}); it is truncated, empty or damaged, "
            f"e.g. by an interrupted save, copy or download. {again}"
        )


def _check_pickle(path: str, cannot: str, again: str) -> None:
    """Read the pickle as PEFT's loader will (`torch.load(weights_only=True)`: nothing in it runs), so that what that
    read refuses or fails on is refused before PEFT adds the adapter."""
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{cannot}: '{path}' is refused by `torch.load(weights_only=True)`, with which PEFT reads pickled weights "
            f"({_torch_reason(error)}): it is no pickle of tensors only (one that would run code when read is refused "
            "so, unrun), or no pickle at all. Nothing was loaded. Load the adapter only from a source you trust, "
            f"preferably saved as {SAFETENSORS_WEIGHTS_NAME} (`save_pretrained` without `safe_serialization=False`)."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise ValueError(
            f"{cannot}: '{path}' is not a complete pickle of weights ({_torch_reason(error)}); it is truncated, empty "
            f"or damaged, e.g. by an interrupted save, copy or download. {again}"
        ) from None
    if not isinstance(weights, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in weights.items()
    ):
        raise ValueError(
            f"{cannot}: '{path}' holds a {type(weights).__name__} that is not the adapter's weights (a dict of "
            f"tensors by name, as `save_pretrained(safe_serialization=False)` writes). {again}"
        )


def _torch_reason(error: BaseException) -> str:
    """What torch says is wrong, in its first sentence: its further lines and sentences say what `weights_only` is and
    how to load the file anyway, which only someone who trusts its source should do."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    boilerplate = ("Weights only load failed", "Check the documentation", "(1)", "(2)")
    specific = [line for line in lines if not line.startswith(boilerplate)]
    reason = (specific or lines or [type(error).__name__])[-1].removeprefix("WeightsUnpickler error:").strip()
    return reason.split(". ")[0].rstrip(".")


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


def _hub_file(model_id: str, subfolder: str | None, name: str, hub_kwargs: dict[str, Any]) -> str:
    """The local path of a repo's file, downloaded into the Hugging Face cache as PEFT's loader downloads it (which
    then finds it there), or the cached copy when offline."""
    return hf_hub_download(
        model_id,
        name,
        subfolder=subfolder or None,
        revision=hub_kwargs.get("revision"),
        repo_type=hub_kwargs.get("repo_type"),
        cache_dir=hub_kwargs.get("cache_dir"),
        token=hub_kwargs.get("token"),
        local_files_only=bool(hub_kwargs.get("local_files_only")),
    )

"""Which base model a Bitune adapter belongs to: recorded when the adapter is created, checked when it is loaded.

An adapter's weights fit any base model of the same hidden sizes, so loading it onto another base (another vocabulary,
or a random model of the same shape) would work without a word and answer nonsense. PEFT records the base's name
(`base_model_name_or_path`); a Bitune config also records its vocabulary size and layer count. A base of another
shape is refused, by name of what differs; a base of another name only warns, since one model has many names (a Hub
id, a local copy, a fine-tuned variant of the same shape). Adapters saved before the shape was recorded still load.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from ..utils.base_model import num_layers, text_config

# A Hub cache snapshot folder, `.../models--<owner>--<name>/snapshots/<revision>`, names the repo `<owner>/<name>`.
_HUB_CACHE_SNAPSHOT = re.compile(r"models--(?P<repo>[^/\\]+)[/\\]snapshots[/\\]")


def base_model_shape(model: Any) -> dict[str, int | None]:
    """The shape a Bitune config records of its base model, under the config's field names."""
    return {
        "base_model_vocab_size": getattr(text_config(model), "vocab_size", None),
        "base_model_num_hidden_layers": num_layers(model),
    }


def match_base_model(config: Any, model: Any, adapter_name: str) -> None:
    """
    Record the shape of `model` in `config` where the config has none (a new adapter, or one saved before the shape was
    recorded); otherwise refuse a `model` of another shape before any weight is created, and warn when the base model
    was given under another name than the recorded one.
    """
    shape = base_model_shape(model)
    recorded = {name: getattr(config, name) for name in shape}
    differ = [name for name, value in recorded.items() if value is not None and value != shape[name]]
    if differ:
        what = " and ".join(_WHAT[name].format(recorded=recorded[name], given=shape[name]) for name in differ)
        base = config.base_model_name_or_path
        raise ValueError(
            f"The Bitune adapter `{adapter_name}` was made on a base model with {what}"
            + (f", `{base}`" if base else "")
            + ": this base model is another one, and the adapter would silently give wrong answers on it. Load it "
            "onto the base model it was trained on (`AutoPeftModelForCausalLM.from_pretrained(path)` loads the "
            "recorded one); if tokens were added to the base before training, resize its embeddings the same way "
            "first. A `BituneConfig` used for one base model cannot be reused for another: make a new one."
        )
    for name, value in shape.items():
        if recorded[name] is None:
            setattr(config, name, value)
    given = getattr(model, "name_or_path", None) or None
    recorded_name = config.base_model_name_or_path
    if recorded_name and given and _canonical_name(recorded_name) != _canonical_name(given):
        warnings.warn(
            f"The Bitune adapter `{adapter_name}` was made on the base model '{recorded_name}', and is being used "
            f"with '{given}'. If that is another model (not a copy of the same one), the adapter's answers are not "
            "what it was trained for.",
            stacklevel=2,
        )


_WHAT = {
    "base_model_vocab_size": "a vocabulary of {recorded} tokens (this base model has {given})",
    "base_model_num_hidden_layers": "{recorded} decoder layers (this base model has {given})",
}


def _canonical_name(name: str) -> str:
    """One spelling of a base model's name: a Hub cache snapshot folder as its repo id, a local folder as its real
    path, a repo id as it is."""
    snapshot = _HUB_CACHE_SNAPSHOT.search(str(name))
    if snapshot:
        return snapshot["repo"].replace("--", "/")
    if os.path.isdir(name):
        return os.path.realpath(name)
    return str(name)

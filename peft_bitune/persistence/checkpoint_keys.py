"""How a Bitune adapter's weights map to checkpoint keys (save, load, Hub): the work of `BituneModel`'s
checkpoint hooks, which PEFT calls.

In the model, the inner PEFT method names the two weight sets of the Bitune adapter `<name>` `"<name>__causal"` and
`"<name>__bidirectional"`, and the tuner holds the mixing scalars in `bitune_mixers[<name>]`. A checkpoint is
independent of the adapter name, like every PEFT checkpoint, and names the weight set instead:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.causal.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.bidirectional.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.causal.weight      (DoRA)
    base_model.model.model.layers.0.mlp.down_proj.ia3_l.causal                                (IA3)
    base_model.bitune_mixers.key_weights
    base_model.bitune_mixers.value_weights

so that `load_adapter(path, adapter_name="task2")` loads it under any name. PEFT's default adapter-name handling
cannot do this: it looks for the adapter name as a whole key segment, and `"default__causal"` is not `"default"`.

Loading is all-or-nothing: a checkpoint that lacks any weight of the adapter (a weight set, the mixing scalars), holds
weights this model has no place for, holds weights of another shape (another base model) or holds NaN or infinite
values is refused before anything is copied into the model. PEFT itself only warns about missing keys and never checks
that a tensor it loads belongs anywhere.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from peft import PeftModel
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from .. import compat
from ..constants import INNER_SEPARATOR, MIXERS_ATTRIBUTE, WEIGHT_SETS, inner_adapter_name

# Checkpoint keys of the mixing scalars (adapter name removed; the "base_model." prefix may be absent).
MIXER_CHECKPOINT_KEYS = {"keys": f"{MIXERS_ATTRIBUTE}.key_weights", "values": f"{MIXERS_ATTRIBUTE}.value_weights"}
_PEFT_PREFIX = "base_model.model."
# The instance attribute of a config whose adapter PEFT is adding to load its weights (see `mark_added_to_load`).
_ADDED_TO_LOAD = "_bitune_added_to_load"
# How many offending keys an error message lists before it says "and N more".
_SHOWN_KEYS = 5


def saved_adapter_state(
    tuner_cls: type, model: nn.Module, config: Any, adapter_name: str, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """
    The entries of `adapter_name` that a checkpoint holds: both weight sets on the tuner layers, the mixing scalars,
    and the base-layer biases if the inner method trains them (`tuner_cls._get_learnable_bias_state_dict`, PEFT's).
    PEFT's own filter of other adapters does not recognise inner adapter names, so the selection is made here,
    structurally, for this adapter's names only.
    """
    _check_is_bitune_peft_model(model, tuner_cls, "saved")
    _check_no_auxiliary_modules(model)
    selected = _adapter_state(model, config, adapter_name, state_dict)
    selected.update(tuner_cls._get_learnable_bias_state_dict(model, state_dict, config.adapter_config))
    return selected


def checkpoint_key(key: str, adapter_name: str) -> str:
    """
    `...lora_A.<name>__causal.weight` -> `...lora_A.causal.weight`; `...bitune_mixers.<name>.key_weights` ->
    `...bitune_mixers.key_weights`. Other keys (e.g. trained biases) carry no adapter name and are unchanged.
    """
    renamed, count = _inner_name_pattern(adapter_name).subn(r".\1", key)
    if count:
        return renamed
    mixer_segment = f"{MIXERS_ATTRIBUTE}.{adapter_name}."
    if key.startswith(mixer_segment) or f".{mixer_segment}" in key:
        return key.replace(mixer_segment, f"{MIXERS_ATTRIBUTE}.", 1)
    return key


def loaded_adapter_state(
    tuner_cls: type, model: nn.Module, config: Any, adapter_name: str, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """
    Map checkpoint keys back to the model keys of `adapter_name`, after checking that the checkpoint holds exactly
    this adapter's weights with this model's shapes.
    """
    _check_is_bitune_peft_model(model, tuner_cls, "loaded")
    model_state = model.state_dict()
    checkpoint_to_model = {
        checkpoint_key(model_key, adapter_name): model_key
        for model_key in _adapter_state(model, config, adapter_name, model_state)
    }
    checkpoint_to_model.update(
        {key: key for key in tuner_cls._get_learnable_bias_state_dict(model, model_state, config.adapter_config)}
    )
    # A checkpoint may omit the PEFT prefix when it was written without a PeftModel around the tuner.
    remapped = {}
    for key, value in state_dict.items():
        if key not in checkpoint_to_model and _PEFT_PREFIX + key in checkpoint_to_model:
            key = _PEFT_PREFIX + key
        remapped[checkpoint_to_model.get(key, key)] = value
    try:
        _check_complete(config, checkpoint_to_model, set(remapped), adapter_name)
        _check_no_strangers(config, remapped, model_state)
        _check_shapes(config, remapped, model_state)
        _check_finite(state_dict, adapter_name)
    except Exception:
        _forget_refused_adapter(model, adapter_name, config)
        raise
    vars(config).pop(_ADDED_TO_LOAD, None)
    return _placed_for_meta_scalars(model, remapped, model_state)


def _placed_for_meta_scalars(
    model: nn.Module, remapped: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Under `low_cpu_mem_usage`, PEFT assigns the loaded tensors instead of copying them and then moves the tuner
    layers' weights next to their base layers; the mixing scalars, made on the meta device, are placed here on the
    base model's device (where they are made without `low_cpu_mem_usage`)."""
    if not any(model_state[key].is_meta for key in remapped if f".{MIXERS_ATTRIBUTE}." in f".{key}"):
        return remapped
    device = next(parameter.device for parameter in model.parameters() if not parameter.is_meta)
    return {
        key: value.to(device) if f".{MIXERS_ATTRIBUTE}." in f".{key}" and model_state[key].is_meta else value
        for key, value in remapped.items()
    }


def saved_mixing_scalars(weights_path: str) -> dict[str, torch.Tensor]:
    """The mixing weights (`{"keys": ..., "values": ...}`, the scalars `BituneKVMixer` holds, not yet alphas) of the
    adapter saved in `weights_path`, an `adapter_model.safetensors`, read without loading any model."""
    from safetensors import safe_open

    weights = {}
    with safe_open(weights_path, framework="pt") as file:
        for kind, suffix in MIXER_CHECKPOINT_KEYS.items():
            keys = [key for key in file.keys() if key == suffix or key.endswith("." + suffix)]
            if len(keys) != 1:
                raise ValueError(
                    f"Expected one tensor ending in {suffix!r} in {weights_path}, found {keys or 'none'}: this is not "
                    "a checkpoint of this version of peft-bitune."
                )
            weights[kind] = file.get_tensor(keys[0])
    return weights


def mark_added_to_load(config: Any) -> None:
    """Mark a config read from an adapter's files (`BituneConfig.from_pretrained`): PEFT adds the adapter, then loads
    its weights, and if the weights are refused, the adapter was added for nothing and is removed again. Not a
    dataclass field, so never saved; removed once the weights are loaded."""
    vars(config)[_ADDED_TO_LOAD] = True


def _forget_refused_adapter(model: nn.Module, adapter_name: str, config: Any) -> None:
    """
    PEFT adds an adapter before it reads its weights: a refusal of them must not leave it behind, randomly
    initialised. `load_adapter` under a new name added it: it is deleted. `PeftModel.from_pretrained` added it as the
    first adapter, into the caller's base model: its layers are taken out again (`unload`), so that the base model can
    be used again as it was. An adapter that existed before the load (the Trainer's resuming loads into the adapter it
    trains) keeps the weights it had. A file PEFT cannot read at all is refused before PEFT adds the adapter
    (`BituneConfig.from_pretrained`, see `weights_files.check_adapter_weights`).
    """
    if not vars(config).pop(_ADDED_TO_LOAD, False) or adapter_name not in getattr(model, "peft_config", {}):
        return
    if len(model.peft_config) > 1:
        model.delete_adapter(adapter_name)
    else:
        model.base_model.unload()


# ---------------------------------------------------------------------------------------------------------- selection
def _inner_names(config: Any, adapter_name: str) -> list[str]:
    return [inner_adapter_name(adapter_name, weight_set) for weight_set in config.weight_sets]


def _inner_name_pattern(adapter_name: str) -> re.Pattern[str]:
    """Matches the inner adapter name as one whole key segment, capturing the weight set."""
    sets = "|".join(WEIGHT_SETS)
    return re.compile(rf"\.{re.escape(adapter_name)}{INNER_SEPARATOR}({sets})(?=\.|$)")


def _adapter_state(
    model: nn.Module, config: Any, adapter_name: str, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """
    The entries of `state_dict` that belong to this adapter: found structurally (what lives on tuner layers and on
    the tuner, as PEFT does), then narrowed to this adapter's inner names and mixer.
    """
    tuner_state = compat.tuner_state(model, state_dict)
    names = "|".join(re.escape(name) for name in _inner_names(config, adapter_name))
    own = re.compile(rf"\.(?:{names})(?:\.|$)|(?:^|\.){MIXERS_ATTRIBUTE}\.{re.escape(adapter_name)}(?:\.|$)")
    return {key: value for key, value in tuner_state.items() if own.search(key)}


def _check_is_bitune_peft_model(model: nn.Module, tuner_cls: type, action: str) -> None:
    """Refuse transformers' built-in adapter loading, which would inject the weights and run only the causal ones."""
    if not (isinstance(model, PeftModel) and isinstance(model.base_model, tuner_cls)):
        raise ValueError(
            f"A Bitune adapter can only be {action} through PEFT's `PeftModel`, which runs its two prompt passes; "
            f"got a {type(model).__name__}. transformers' own adapter support (`model.load_adapter(...)`, "
            "`AutoModelForCausalLM.from_pretrained(<adapter>)`) would run only the causal weights and silently give "
            "other results. Use `PeftModel.from_pretrained(base_model, path)` or "
            "`AutoPeftModelForCausalLM.from_pretrained(path)` after `import peft_bitune`."
        )


# ------------------------------------------------------------------------------------------------------------- checks
def _check_no_auxiliary_modules(model: nn.Module) -> None:
    """
    `modules_to_save` / `trainable_token_indices` of the inner method wrap whole modules under inner adapter names,
    which PEFT's saving looks up under the Bitune adapter name: it would drop them, or fail with a bare KeyError.
    """
    wrapped = [name for name, module in model.named_modules() if isinstance(module, AuxiliaryTrainingWrapper)]
    if wrapped:
        raise NotImplementedError(
            f"Bitune adapters cannot save `modules_to_save` or `trainable_token_indices` of the inner PEFT config "
            f"(found on {_listing(wrapped)}): they are not split into causal and bidirectional weight sets, and PEFT "
            "would leave them out of the checkpoint. Train without them (remove them from `adapter_config`)."
        )


def _listing(keys: list[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown if len(keys) <= _SHOWN_KEYS else f"{shown} and {len(keys) - _SHOWN_KEYS} more"


def _base_model_hint(config: Any) -> str:
    base = getattr(config, "base_model_name_or_path", None)
    recorded = f"The adapter was saved from base model `{base}`. " if base else ""
    return (
        f"{recorded}Load it on the same base model it was trained on (same architecture and size); "
        "`AutoPeftModelForCausalLM.from_pretrained(path)` loads the recorded one."
    )


def _check_complete(config: Any, checkpoint_to_model: dict[str, str], loaded: set[str], adapter_name: str) -> None:
    missing = [key for key, model_key in checkpoint_to_model.items() if model_key not in loaded]
    if not missing:
        return
    parts = []
    if any(f".{MIXERS_ATTRIBUTE}." in f".{key}" for key in missing):
        parts.append("the mixing scalars (`bitune_mixers.key_weights` / `value_weights`)")
    for weight_set in WEIGHT_SETS:
        if any(f".{weight_set}." in f"{key}." for key in missing):
            parts.append(f"weights of the {weight_set} set")
    what = " and ".join(parts) or "biases trained by the inner method"
    raise ValueError(
        f"The checkpoint of Bitune adapter `{adapter_name}` is incomplete: it lacks {what} "
        f"({len(missing)} tensors, e.g. {_listing(missing)}). Loading it would leave those at their random "
        "initialisation, so nothing was loaded. The file may be truncated, edited, or written by a different "
        f"adapter config. {_base_model_hint(config)}"
    )


def _check_no_strangers(config: Any, remapped: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor]) -> None:
    strangers = [key for key in remapped if key not in model_state]
    if strangers:
        raise ValueError(
            f"The Bitune checkpoint holds {len(strangers)} tensors this model has no place for (e.g. "
            f"{_listing(strangers)}): it does not match this base model or adapter config. {_base_model_hint(config)}"
        )


def _check_finite(state_dict: dict[str, torch.Tensor], adapter_name: str) -> None:
    """Refuse NaN or infinite values anywhere in the adapter: a model loaded with them generates nothing but one token
    (a NaN mixing scalar makes every mixed key NaN), without a word."""
    for key, value in state_dict.items():
        if torch.is_floating_point(value) and not bool(torch.isfinite(value).all()):
            count = int((~torch.isfinite(value)).sum())
            raise ValueError(
                f"The checkpoint of Bitune adapter `{adapter_name}` holds non-finite values (NaN or infinity): "
                f"`{key}` has {count} of them (the first bad tensor). The file is damaged, or was saved after "
                "training diverged; nothing was loaded. Use an earlier checkpoint, or train again (with a lower "
                "learning rate if the loss went to NaN)."
            )


def _check_shapes(config: Any, remapped: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor]) -> None:
    mismatched = [
        f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(model_state[key].shape)}"
        for key, value in remapped.items()
        if tuple(value.shape) != tuple(model_state[key].shape)
    ]
    if mismatched:
        raise ValueError(
            f"The Bitune checkpoint does not fit this base model: {len(mismatched)} tensors have other shapes "
            f"({_listing(mismatched)}). {_base_model_hint(config)} (A Bitune adapter is never loaded partially, so "
            "`ignore_mismatched_sizes` does not apply.)"
        )

"""A saved Bitune adapter as the vLLM plugin reads it: both LoRA weight sets per base module, and the mixing scalars.

Read from the adapter folder's `adapter_config.json`, through PEFT's config loading as `PeftModel.from_pretrained`
reads it (so the defaults of what the file leaves out are PEFT's and `BituneConfig`'s own), and
`adapter_model.safetensors` (the checkpoint keys are those of `peft_bitune.persistence.checkpoint_keys`). Only what the
plugin computes exactly is accepted: plain LoRA weight sets on the attention and MLP projections; anything else is
refused here, before an engine starts, naming the cause.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from peft_bitune import BituneConfig
from peft_bitune.constants import BIDIRECTIONAL, CAUSAL, MIXERS_ATTRIBUTE, WEIGHT_SETS, WeightSet, peft_type_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections the plugin adapts: those PEFT's "all-linear" targets on the supported families.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.(?P<set>\w+)\.weight$")


@dataclass(frozen=True)
class LoraPair:
    """One weight set's LoRA on one base module: `delta(x) = (x @ A.T) @ B.T * scaling`, as PEFT computes it."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass
class BituneAdapter:
    """
    What the plugin needs of a saved Bitune adapter.

    Args:
        base_model (`str`): `base_model_name_or_path` of the adapter config, the model vLLM loads.
        lora (`dict`): `lora[module_path][weight_set]` is a `LoraPair`; `module_path` is the transformers module
            path, e.g. `model.layers.0.self_attn.q_proj`.
        key_weights, value_weights (`torch.Tensor`): the mixing scalars, float32, one per decoder layer.
        mix_scale (`float`): the constant `s` of `alpha = |w| / (|w| + s)`.
        mixed_layers (`list[int] | None`): the mixed layers (all when None).
        second_pass_attention (`str`): the mask of the bidirectional prompt pass.
        multi_turn (`str`): how the adapter was trained on multi-turn rows.
    """

    base_model: str
    lora: dict[str, dict[WeightSet, LoraPair]]
    key_weights: torch.Tensor
    value_weights: torch.Tensor
    mix_scale: float
    mixed_layers: list[int] | None
    second_pass_attention: str
    multi_turn: str


def read_config(folder: str) -> BituneConfig:
    """The adapter's config, refused if it is not a Bitune adapter."""
    from peft import PeftConfig

    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        raise FileNotFoundError(f"No {CONFIG_FILE} in {folder!r}: pass the folder a Bitune adapter was saved to.")
    config = PeftConfig.from_pretrained(folder)  # the config class of the file's `peft_type`
    if not isinstance(config, BituneConfig):
        raise ValueError(
            f"{folder!r} holds a {peft_type_name(config.peft_type)} adapter, not a Bitune one: vLLM serves plain LoRA "
            "adapters itself (`enable_lora=True`); this plugin serves Bitune adapters."
        )
    return config


def check_inner_method(config: BituneConfig) -> None:
    """Refuse, naming it, an inner PEFT method or LoRA option the plugin does not compute."""
    inner = config.adapter_config
    method = peft_type_name(inner.peft_type)
    if method != "LORA":
        raise ValueError(
            f"This Bitune adapter's weight sets are {method}; the vLLM plugin computes LoRA weight sets only. Serve "
            "it with `bitune-serve` (peft_bitune.serving), or train the adapter with LoRA."
        )
    options = {
        "use_dora": "DoRA (`use_dora=True`)",
        "lora_bias": "LoRA biases (`lora_bias=True`)",
        "rank_pattern": "per-module ranks (`rank_pattern`)",
        "alpha_pattern": "per-module alphas (`alpha_pattern`)",
        "layers_to_transform": "`layers_to_transform`",
        "target_parameters": "`target_parameters`",
    }
    for name, what in options.items():
        if getattr(inner, name, None):
            raise ValueError(
                f"This Bitune adapter uses {what}, which the vLLM plugin does not compute: serve it with "
                "`bitune-serve` (peft_bitune.serving), or train the adapter without it."
            )
    if inner.bias != "none":
        raise ValueError(
            f"This Bitune adapter trains base-layer biases (`bias={inner.bias!r}`), which the vLLM plugin does not "
            "load: serve it with `bitune-serve`, or train with `bias='none'`."
        )


def read_adapter(folder: str) -> BituneAdapter:
    """Read and check a Bitune adapter folder (config and weights)."""
    from safetensors.torch import load_file

    config = read_config(folder)
    check_inner_method(config)
    inner = config.adapter_config
    scaling = inner.lora_alpha / (math.sqrt(inner.r) if inner.use_rslora else inner.r)
    weights_path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"No {WEIGHTS_FILE} in {folder!r}: save the adapter with `save_pretrained`.")
    state = load_file(weights_path)
    mixer_keys = {
        "keys": f"base_model.{MIXERS_ATTRIBUTE}.key_weights",
        "values": f"base_model.{MIXERS_ATTRIBUTE}.value_weights",
    }
    missing = [key for key in mixer_keys.values() if key not in state]
    if missing:
        raise ValueError(f"{weights_path} lacks the mixing scalars {missing}: it is not a complete Bitune adapter.")
    parts: dict[str, dict[WeightSet, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        if key in mixer_keys.values():
            continue
        match = _LORA_KEY.match(key)
        if match is None or match["set"] not in WEIGHT_SETS:
            raise ValueError(f"{weights_path} holds {key!r}, which the vLLM plugin does not know how to apply.")
        module = match["module"]
        if module.rsplit(".", 1)[-1] not in SUPPORTED_MODULES:
            raise ValueError(
                f"This Bitune adapter adapts {module!r}; the vLLM plugin adapts only {', '.join(SUPPORTED_MODULES)}. "
                "Serve it with `bitune-serve`, or train with those target modules."
            )
        parts.setdefault(module, {}).setdefault(match["set"], {})[match["part"]] = tensor.float()
    lora: dict[str, dict[WeightSet, LoraPair]] = {}
    shared = config.shared_weights
    for module, sets in parts.items():
        if shared:  # one weight set (the causal one) serves both prompt passes
            sets[BIDIRECTIONAL] = sets[CAUSAL]
        lora[module] = {name: LoraPair(pair["A"], pair["B"], scaling) for name, pair in sets.items()}
        if set(lora[module]) != set(WEIGHT_SETS):
            raise ValueError(f"{weights_path} lacks a weight set of {module!r}: it is not a complete Bitune adapter.")
    return BituneAdapter(
        base_model=config.base_model_name_or_path,
        lora=lora,
        key_weights=state[mixer_keys["keys"]].float(),
        value_weights=state[mixer_keys["values"]].float(),
        mix_scale=float(config.mix_scale),
        mixed_layers=config.mixed_layers,
        second_pass_attention=config.second_pass_attention,
        multi_turn=config.multi_turn,
    )

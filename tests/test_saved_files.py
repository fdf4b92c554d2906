"""
The promise of issue 48 about saved files: code may move inside the packages, but an adapter's files stay as they
are. The keys of `adapter_model.safetensors` and the fields of `adapter_config.json` are pinned with literal values,
and PEFT loads them back. The oldest-versions CI job runs this file too (PEFT's own config fields differ between
releases, so only Bitune's are pinned exactly).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from safetensors import safe_open

from peft_bitune import BituneConfig, BituneModel

# ------------------------------------------------------------------------------------------------ the saved files
# `adapter_model.safetensors` of `get_peft_model(tiny 2-layer Llama, BituneConfig())`: the default inner LoRA on every
# linear layer (`all-linear`: q/k/v/o and gate/up/down, not `lm_head`), both weight sets, and the mixing scalars (one
# per layer, in a tensor). PEFT leaves the adapter name ("default") out of the keys. LoRA's key layout has been the
# same in every PEFT release this project supports.
SAVED_KEYS = [
    "base_model.bitune_mixers.key_weights",
    "base_model.bitune_mixers.value_weights",
    "base_model.model.model.layers.0.mlp.down_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.mlp.down_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.mlp.down_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.mlp.down_proj.lora_B.causal.weight",
    "base_model.model.model.layers.0.mlp.gate_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.mlp.gate_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.mlp.gate_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.mlp.gate_proj.lora_B.causal.weight",
    "base_model.model.model.layers.0.mlp.up_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.mlp.up_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.mlp.up_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.mlp.up_proj.lora_B.causal.weight",
    "base_model.model.model.layers.0.self_attn.k_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.k_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.self_attn.k_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.k_proj.lora_B.causal.weight",
    "base_model.model.model.layers.0.self_attn.o_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.o_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.self_attn.o_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.o_proj.lora_B.causal.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.causal.weight",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.causal.weight",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.mlp.down_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.mlp.down_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.mlp.down_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.mlp.down_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.mlp.gate_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.mlp.gate_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.mlp.gate_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.mlp.gate_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.mlp.up_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.mlp.up_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.mlp.up_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.mlp.up_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.self_attn.k_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.k_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.self_attn.k_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.k_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.self_attn.o_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.o_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.self_attn.o_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.o_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.self_attn.q_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.q_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.self_attn.q_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.q_proj.lora_B.causal.weight",
    "base_model.model.model.layers.1.self_attn.v_proj.lora_A.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.v_proj.lora_A.causal.weight",
    "base_model.model.model.layers.1.self_attn.v_proj.lora_B.bidirectional.weight",
    "base_model.model.model.layers.1.self_attn.v_proj.lora_B.causal.weight",
]

# `adapter_config.json`'s top level holds PEFT's own fields (those of `peft.PeftConfig`) and Bitune's. Bitune's are
# pinned exactly, with their values for the tiny model (`mixed_layers` is left out at its default, so that earlier
# versions of peft-bitune, which refuse unknown fields, still load the adapter). PEFT's own are pinned only as a
# superset of this minimal set: a newer PEFT release may add a field to `PeftConfig`, which is PEFT's file format, not
# a move of ours, and the oldest-versions CI job runs an older PEFT than the newest one.
BITUNE_CONFIG = {
    "base_model_num_hidden_layers": 2,
    "base_model_vocab_size": 96,
    "mix_init": 0.01,
    "mix_scale": 0.01,
    "multi_turn": "alternating",
    "second_pass_attention": "bidirectional",
    "shared_weights": False,
    "train_mixing": True,
}
BITUNE_CONFIG_KEYS = set(BITUNE_CONFIG) | {"adapter_config"}  # `adapter_config`: the inner method's, checked below
PEFT_CONFIG_KEYS_AT_LEAST = {
    "auto_mapping",
    "base_model_name_or_path",
    "inference_mode",
    "peft_type",
    "revision",
    "task_type",
}
# The nested inner method's config is PEFT's `LoraConfig.to_dict()`, whose fields grow with PEFT releases (new LoRA
# variants each add one): the values Bitune's default sets (`default_adapter_config`) are pinned, and its keys only as
# a superset of these.
INNER_CONFIG = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": "all-linear",
}
INNER_CONFIG_KEYS_AT_LEAST = set(INNER_CONFIG) | {
    "bias",
    "fan_in_fan_out",
    "inference_mode",
    "init_lora_weights",
    "layers_to_transform",
    "lora_dropout",
    "modules_to_save",
    "use_dora",
    "use_rslora",
}


@pytest.fixture
def saved_adapter(load_base, tmp_path):
    """`get_peft_model(tiny Llama, BituneConfig())` with every adapter weight and mixing scalar set to random values
    (so that a reload that kept PEFT's initial values would be seen), saved; returns (model, folder)."""
    model = get_peft_model(load_base("llama"), BituneConfig())
    generator = torch.Generator().manual_seed(48)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    with torch.no_grad():
        for parameter in trainable:
            parameter.copy_(torch.rand(parameter.shape, generator=generator) * 0.1 + 0.01)
    model.save_pretrained(tmp_path)
    return model, tmp_path


def test_saved_weights_have_exactly_the_pinned_keys(saved_adapter):
    """Issue 48: `adapter_model.safetensors` keeps its keys (both weight sets under `.causal`/`.bidirectional`, the
    mixing scalars under `base_model.bitune_mixers`), so adapters saved before a move load after it and vice versa."""
    _, folder = saved_adapter
    with safe_open(folder / "adapter_model.safetensors", framework="pt") as weights:
        keys = sorted(weights.keys())
        mixer_shapes = [tuple(weights.get_slice(key).get_shape()) for key in SAVED_KEYS[:2]]
    assert keys == SAVED_KEYS
    assert mixer_shapes == [(2,), (2,)]


def test_saved_config_has_the_pinned_fields(saved_adapter):
    """Issue 48: `adapter_config.json` keeps Bitune's fields and values, `peft_type` "BITUNE", and the inner method's
    config nested under `adapter_config` with its own `peft_type`."""
    _, folder = saved_adapter
    saved = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    peft_fields = {field.name for field in dataclasses.fields(PeftConfig)}
    assert set(saved) - peft_fields == BITUNE_CONFIG_KEYS
    assert set(saved) & peft_fields >= PEFT_CONFIG_KEYS_AT_LEAST
    assert {key: saved[key] for key in BITUNE_CONFIG} == BITUNE_CONFIG
    assert (saved["peft_type"], saved["task_type"]) == ("BITUNE", "CAUSAL_LM")
    inner = saved["adapter_config"]
    assert isinstance(inner, dict)
    assert set(inner) >= INNER_CONFIG_KEYS_AT_LEAST
    assert {key: inner[key] for key in INNER_CONFIG} == INNER_CONFIG


def test_saved_config_writes_mixed_layers_only_when_set(load_base, tmp_path):
    """Issue 48: `mixed_layers` keeps its name in `adapter_config.json` when set, and stays out of the file at its
    default (so that adapters without it still load in earlier versions)."""
    get_peft_model(load_base("llama"), BituneConfig(mixed_layers=[1])).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text(encoding="utf-8"))
    assert saved["mixed_layers"] == [1]
    peft_fields = {field.name for field in dataclasses.fields(PeftConfig)}
    assert set(saved) - peft_fields == BITUNE_CONFIG_KEYS | {"mixed_layers"}


def test_saved_adapter_loads_back_with_equal_tensors(saved_adapter, load_base):
    """Issue 48: what was saved loads with `PeftModel.from_pretrained` into a Bitune model whose every tensor (both
    weight sets, the mixing scalars, the base) equals the saved model's."""
    model, folder = saved_adapter
    loaded = PeftModel.from_pretrained(load_base("llama"), folder)
    assert isinstance(loaded.base_model, BituneModel)
    assert isinstance(loaded.peft_config["default"], BituneConfig)
    expected, actual = model.state_dict(), loaded.state_dict()
    assert sorted(actual) == sorted(expected)
    differing = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert differing == []
    # The fixture's random values, not `mix_init`'s: the equality above is not that of two freshly made adapters.
    mixers = loaded.base_model.bitune_mixers["default"]
    assert not torch.equal(mixers.key_weights, torch.full_like(mixers.key_weights, 0.01))

"""The private attributes and methods of transformers, PEFT, torch, accelerate and bitsandbytes that peft-bitune relies
on (all used through peft_bitune/compat.py): one test each, checking that the installed release still behaves as
compat.py assumes, so that an upgrade that moves one fails here, by name, instead of silently changing what Bitune
computes."""

from __future__ import annotations

import pytest
import torch
from peft import PeftType
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from bitsandbytes_support import why_bitsandbytes_cannot_run
from peft_bitune import BituneConfig, compat
from peft_bitune.constants import BITUNE_TYPE_NAME, inner_adapter_name
from peft_bitune.tuner.caches import pass_cache
from peft_bitune.utils.base_model import num_layers
from reference import make_bitune
from tiny_models import VOCAB

UPGRADE = "The installed {library} no longer {does}: update `peft_bitune.compat.{function}` for this release."


def first_tuner_layer(model: nn.Module) -> BaseTunerLayer:
    return next(module for module in model.modules() if isinstance(module, BaseTunerLayer))


def checkpoint_layers(model: nn.Module) -> list[GradientCheckpointingLayer]:
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


# ------------------------------------------------------------------------------------------------------------ PEFT
def test_peft_tuner_layers_route_to_the_adapters_in__active_adapter(load_base):
    model = make_bitune(load_base("llama"))
    layer = first_tuner_layer(model)
    bidirectional = inner_adapter_name("default", "bidirectional")
    compat.route_layers([layer], [bidirectional])
    assert layer.active_adapters == [bidirectional], UPGRADE.format(
        library="PEFT", does="keeps a tuner layer's active adapters in `_active_adapter`", function="route_layers"
    )
    assert compat.routed_adapters(layer) == [bidirectional]


def test_peft_lora_layers_run_each_row_with_the_adapter_named_in_adapter_names(load_base):
    model = make_bitune(load_base("llama"))
    layer = first_tuner_layer(model)
    causal, bidirectional = (inner_adapter_name("default", kind) for kind in ("causal", "bidirectional"))
    x = torch.randn(3, 2, layer.in_features)
    with torch.no_grad():
        mixed = layer(x, adapter_names=[bidirectional, "__base__", causal])
        expected = []
        for row, names in enumerate(([bidirectional], [], [causal])):
            compat.route_layers([layer], names)
            expected.append(layer(x[row : row + 1]))
    assert compat.routes_rows(layer), UPGRADE.format(
        library="PEFT", does="give LoRA layers `_mixed_batch_forward`", function="routes_rows")
    torch.testing.assert_close(mixed, torch.cat(expected), atol=1e-6, rtol=0, msg=UPGRADE.format(
        library="PEFT", does="run each row of a LoRA layer with the adapter `adapter_names` names for it",
        function="routes_rows"))


def test_peft_type_enum_takes_a_new_member():
    member = compat.add_peft_type(BITUNE_TYPE_NAME)
    found = (PeftType[BITUNE_TYPE_NAME] is member, PeftType(BITUNE_TYPE_NAME) is member, member in list(PeftType))
    assert found == (True, True, True), UPGRADE.format(
        library="PEFT", does="has `PeftType` as a plain str Enum (`_member_map_`, ...)", function="add_peft_type"
    )
    assert member.value == BITUNE_TYPE_NAME and isinstance(member, str)


def test_peft_finds_the_tuner_state_by_its_key_prefixes(load_base):
    model = make_bitune(load_base("llama"))
    state = compat.tuner_state(model, model.state_dict())
    message = UPGRADE.format(
        library="PEFT",
        does="selects a tuner's state with `_get_tuner_state_dict_key_prefixes`",
        function="tuner_state",
    )
    assert state, message
    assert all("lora_" in key or "bitune_mixers" in key for key in state), message
    assert any("bitune_mixers" in key for key in state), message


def test_peft_config_splits_off_the_hub_arguments():
    split = compat.hub_kwargs(BituneConfig, {"revision": "v1", "cache_dir": "/tmp/c", "mix_init": 0.5, "other": 1})
    assert split == {"revision": "v1", "cache_dir": "/tmp/c"}, UPGRADE.format(
        library="PEFT", does="splits `from_pretrained` kwargs with `PeftConfig._split_kwargs`", function="hub_kwargs"
    )


@pytest.mark.parametrize("hook", compat.OVERRIDDEN_TUNER_HOOKS)
def test_peft_tuners_still_have_the_hooks_bitune_overrides(hook):
    assert hasattr(BaseTuner, hook), (
        f"PEFT's BaseTuner no longer has `{hook}`, which BituneModel overrides: PEFT would no longer call the "
        "override. Find what replaced it and update BituneModel (and `compat.OVERRIDDEN_TUNER_HOOKS`)."
    )


# ---------------------------------------------------------------------------------------------------- transformers
def test_transformers_checkpointed_layers_keep_their_checkpoint_function(load_base):
    base = load_base("llama")
    compat.enable_checkpointing(base, use_reentrant=False)
    layers = checkpoint_layers(base)
    message = UPGRADE.format(
        library="transformers",
        does="keeps a layer's checkpoint function (a partial of torch's) in `_gradient_checkpointing_func`",
        function="uses_reentrant_checkpointing",
    )
    assert [compat.uses_reentrant_checkpointing(layer) for layer in layers] == [False] * len(layers), message
    compat.enable_checkpointing(base, use_reentrant=True)
    assert [compat.uses_reentrant_checkpointing(layer) for layer in layers] == [True] * len(layers), message


def test_transformers_checkpointed_layers_keep_a_cache_when_told_so(load_base):
    base = load_base("llama").train()
    compat.enable_checkpointing(base, use_reentrant=False)
    layers, calls = checkpoint_layers(base), []
    input_ids = torch.randint(3, VOCAB, (1, 5))

    def counted(checkpoint):
        def wrapped(*args, **kwargs):
            calls.append(1)
            return checkpoint(*args, **kwargs)

        return wrapped

    def recorded_layers() -> int:
        cache = pass_cache(num_layers(base), record=True)
        base(input_ids=input_ids, **compat.with_cache(base, cache), use_cache=False)
        return sum(layer.recorded_keys is not None for layer in cache.layers)

    assert recorded_layers() == 0  # transformers drops the cache of a checkpointed layer by default
    with compat.checkpointed_layers_keep_caches(layers, counted):
        kept = recorded_layers()
    assert (kept, len(calls)) == (num_layers(base), len(layers)), UPGRADE.format(
        library="transformers",
        does="keeps the cache of a checkpointed layer with `_can_checkpoint_with_cache`, or checkpoints through "
        "`_gradient_checkpointing_func`",
        function="checkpointed_layers_keep_caches",
    )
    assert "_can_checkpoint_with_cache" not in vars(layers[0])  # restored: the class default applies again
    assert recorded_layers() == 0


def test_transformers_layer_forward_checkpoints_only_while_gradient_checkpointing_is_set(load_base):
    """`layer_inputs` runs a decoder layer's own `forward` inside the answer pass's layer: transformers (5.25) wraps a
    checkpointing layer's `forward` in its checkpoint, which `checkpointing_paused` turns off for that call."""
    base = load_base("llama").train()
    compat.enable_checkpointing(base, use_reentrant=False)
    layer, calls = checkpoint_layers(base)[0], []
    checkpoint = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda *args, **kwargs: (calls.append(1), checkpoint(*args, **kwargs))[1]
    hidden = torch.randn(1, 3, base.config.hidden_size, requires_grad=True)
    position_embeddings = base.model.rotary_emb(hidden, torch.arange(3)[None])
    with compat.checkpointing_paused(layer):
        type(layer).forward(layer, hidden, position_embeddings=position_embeddings, attention_mask=None)
    assert calls == [] and layer.gradient_checkpointing is True, UPGRADE.format(
        library="transformers", does="checkpoints a layer's `forward` only while `gradient_checkpointing` is set",
        function="checkpointing_paused",
    )


def test_transformers_resolves_and_checks_generation_arguments(load_base):
    base = load_base("llama")
    message = UPGRADE.format(
        library="transformers", does="resolves `generate`'s arguments in `_prepare_generation_config`",
        function="resolved_generation_config",
    )
    assert compat.resolved_generation_config(base, {"max_new_tokens": 3, "do_sample": False}).max_new_tokens == 3, (
        message
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        compat.resolved_generation_config(base, {"max_new_tokens": 0})


def test_transformers_infers_the_attention_mask_from_the_pad_token(load_base):
    base = load_base("llama")
    generation_config = compat.resolved_generation_config(base, {"pad_token_id": 0, "eos_token_id": 2})
    input_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = compat.inferred_attention_mask(base, input_ids, generation_config)
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]], UPGRADE.format(
        library="transformers",
        does="infers the attention mask with `_prepare_special_tokens` and `_prepare_attention_mask_for_generation`",
        function="inferred_attention_mask",
    )


def test_transformers_sliding_window_layers_keep_one_position_less_than_a_bidirectional_window_reaches(load_base):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer
    from transformers.masking_utils import sliding_window_bidirectional_overlay

    config = load_base("mistral").config  # every layer slides, window 6
    window = config.sliding_window
    message = UPGRADE.format(
        library="transformers", does="keeps `sliding_window - 1` positions in a `DynamicSlidingWindowLayer`",
        function="keep_one_more_sliding_position",
    )
    states = torch.randn(1, 2, 10, 8)

    def held(cache) -> list[int]:
        for index in range(len(cache.layers)):
            cache.update(states, states, index)
        return [layer.keys.shape[-2] for layer in cache.layers]

    assert held(DynamicCache(config=config)) == [window - 1] * config.num_hidden_layers, message
    # A bidirectional query reaches `window` positions back, one more than that.
    assert sliding_window_bidirectional_overlay(window)(0, 0, 10, 10 - window), message
    widened = DynamicCache(config=config)
    compat.keep_one_more_sliding_position(widened)
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in widened.layers), message
    assert held(widened) == [window] * config.num_hidden_layers, message
    assert widened.get_seq_length() == 10 and widened.is_sliding == [True] * config.num_hidden_layers


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_config_names_the_attention_implementation(load_base, implementation):
    base = load_base("llama", attn_implementation=implementation)
    assert compat.attention_implementation(base) == implementation, UPGRADE.format(
        library="transformers", does="names the attention implementation in `config._attn_implementation`",
        function="attention_implementation",
    )


# ------------------------------------------------------------------------------------------- torch and accelerate
def test_torch_forward_hooks_are_found():
    module = nn.Linear(2, 2)
    message = UPGRADE.format(
        library="torch", does="keeps forward hooks in `_forward_hooks`/`_forward_pre_hooks`/`_global_forward_hooks`",
        function="forwards_are_hooked",
    )
    assert not compat.forwards_are_hooked([module]), message
    handle = module.register_forward_pre_hook(lambda *args: None)
    assert compat.forwards_are_hooked([module]), message
    handle.remove()
    handle = module.register_forward_hook(lambda *args: None)
    assert compat.forwards_are_hooked([module]), message
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert compat.forwards_are_hooked([module]), message
    finally:
        handle.remove()
    assert not compat.forwards_are_hooked([module])


def test_accelerate_hooks_are_found():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    module = nn.Linear(2, 2)
    add_hook_to_module(module, ModelHook())
    assert compat.forwards_are_hooked([module]), UPGRADE.format(
        library="accelerate", does="marks a hooked module with `_hf_hook`", function="forwards_are_hooked"
    )
    remove_hook_from_module(module)
    assert not compat.forwards_are_hooked([module])


def test_torch_checkpoint_records_the_autocast_state_of_the_device_and_the_cpu():
    """A prompt-pass layer run again in backward enters the autocast state its forward ran under, the CPU's too,
    whatever the device type (CUDA's state comes with the CPU's)."""
    for device_type in ("cpu", "cuda"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            state = compat.autocast_state(device_type)
        assert not torch.is_autocast_enabled("cpu")
        with compat.autocast_restored(state):
            restored = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert restored, UPGRADE.format(
            library="torch", does="records the CPU's autocast state with `checkpoint._get_autocast_kwargs`",
            function="autocast_state",
        )
        assert not torch.is_autocast_enabled("cpu")


def test_torch_marks_the_modules_fsdp_manages(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available():
        pytest.fail("This torch build has no torch.distributed, which peft-bitune's FSDP support needs.")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        assert not compat.is_fsdp_managed(model[0])
        fully_shard(model[0])
        fully_shard(model)
        message = UPGRADE.format(
            library="torch", does="marks modules under FSDP with `_is_fsdp_managed_module`", function="is_fsdp_managed"
        )
        assert compat.is_fsdp_managed(model[0]) and compat.is_fsdp_managed(model), message
        assert compat.forwards_are_hooked([model[0]]), message
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- bitsandbytes
def _4bit_layer(seed: int):
    import bitsandbytes

    torch.manual_seed(seed)
    layer = bitsandbytes.nn.Linear4bit(128, 64, bias=False, compute_dtype=torch.float32)
    layer.weight = bitsandbytes.nn.Params4bit(torch.randn(64, 128), requires_grad=False, quant_type="nf4")
    return layer.to("cpu").eval()


def test_bitsandbytes_repacks_4bit_layers_for_cpu_inference_only_where_compat_expects_it():
    problem = why_bitsandbytes_cannot_run()
    if problem is not None:
        pytest.skip(problem)
    import bitsandbytes

    layer = _4bit_layer(0)
    assert compat.bitsandbytes_4bit_layers([nn.Linear(2, 2), layer]) == [layer]
    can_repack = bool(getattr(layer, "support_avx512bf16_for_cpu", False))
    with torch.no_grad():
        layer(torch.randn(2, 128))
    assert compat.is_repacked_for_cpu_inference(layer) == can_repack, UPGRADE.format(
        library="bitsandbytes",
        does="repacks a 4-bit layer for CPU inference exactly when its `support_avx512bf16_for_cpu` is set, marking "
        "its `quant_state` with `packing_format_for_cpu`",
        function="is_repacked_for_cpu_inference",
    )
    if can_repack:  # the harm the repacking does, and why Bitune keeps it off
        inputs = torch.randn(2, 128, requires_grad=True)
        layer.train()
        layer(inputs).sum().backward()
        assert inputs.grad is None

    kept = _4bit_layer(0)
    original = bitsandbytes.functional.dequantize_4bit(kept.weight.data, kept.weight.quant_state)
    compat.keep_out_of_cpu_inference_layout(kept)
    with torch.no_grad():
        kept(torch.randn(2, 128))
    assert not compat.is_repacked_for_cpu_inference(kept), UPGRADE.format(
        library="bitsandbytes",
        does="leaves a 4-bit layer unpacked when its `support_avx512bf16_for_cpu` is false",
        function="keep_out_of_cpu_inference_layout",
    )
    assert torch.equal(bitsandbytes.functional.dequantize_4bit(kept.weight.data, kept.weight.quant_state), original)
    inputs = torch.randn(2, 128, requires_grad=True)
    kept.train()
    kept(inputs).sum().backward()
    assert inputs.grad is not None


# ------------------------------------------------------------------------------------------------------------- TRL
def test_trl_splits_the_launcher_arguments_off_the_command_line():
    argv = ["--model_name_or_path", "m", "--num_processes", "2", "--output_dir", "out", "--num_processes", "x"]
    assert compat.without_launcher_arguments(argv, ["--num_processes", "2"]) == [
        "--model_name_or_path", "m", "--output_dir", "out", "--num_processes", "x"
    ], UPGRADE.format(library="TRL", does="removes an ordered subsequence of arguments once, in order",
                      function="without_launcher_arguments")

"""
Everything peft-bitune needs from other libraries beyond their public API, decided here and nowhere else.

1. Names that differ between the transformers releases peft-bitune supports:
   - transformers 5.24 renamed the KV cache argument of model forwards and of `generate` from `past_key_values` to
     `cache` (the old name goes away in 5.40 for forwards, in 6.0 for `generate`), and the outputs' `past_key_values`
     attribute to `cache`. Older releases know only `past_key_values`.
   - transformers 5.23 renamed gradient checkpointing to activation checkpointing: the `TrainingArguments`
     `gradient_checkpointing` (and `_kwargs`) and `gradient_checkpointing_enable` became `activation_checkpointing*`
     (the old names go away in 6.0).
2. Private attributes and methods of transformers, PEFT, torch, accelerate, bitsandbytes and TRL that Bitune must read
   or set because no public interface does what it needs: routing PEFT's layers to one weight set, keeping caches in
   checkpointed layers, one more position in the generation cache's sliding-window layers, transformers' own
   resolution of generation arguments, finding hooks around a module's forward, torch checkpoint's record of the
   autocast state, adding a member to PEFT's closed `PeftType` enum, keeping bitsandbytes' 4-bit layers out of their
   CPU inference layout, splitting `bitune-sft`'s command line as `trl sft` does. Each one has a test in
   tests/test_private_interfaces.py that fails with a clear message when an upgrade moves it.

Every other module uses these through the functions here. Overrides of other libraries' private methods must live
on their classes: `BituneKVMixer._apply` (torch's dtype casts; tested in tests/test_forward.py) and the `BaseTuner`
hooks of `BituneModel` and its checkpoint mixin, listed in `OVERRIDDEN_TUNER_HOOKS` below and tested there too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from peft.tuners.tuners_utils import (
    BaseTunerLayer,
    _filter_state_dict_by_key_prefixes,
    _get_tuner_state_dict_key_prefixes,
)
from peft.utils import PeftType
from torch import nn
from transformers import PreTrainedModel, TrainingArguments
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.modeling_layers import GradientCheckpointingLayer
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


# ---------------------------------------------------------------------------------------------------- transformers
def uses_reentrant_checkpointing(layer: GradientCheckpointingLayer) -> bool:
    """Whether the layer's checkpoint function is reentrant (transformers keeps it, a `functools.partial` of torch's
    `checkpoint`, in `_gradient_checkpointing_func`; torch's default is reentrant)."""
    function = getattr(layer, "_gradient_checkpointing_func", None)
    keywords = getattr(function, "keywords", {}) or {}
    return keywords.get("use_reentrant", True) is not False


@contextmanager
def checkpointed_layers_keep_caches(
    layers: Sequence[GradientCheckpointingLayer], wrap_checkpoint: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """
    Within the block, checkpointed `layers` keep the cache they are given (transformers drops it unless a layer's
    `_can_checkpoint_with_cache` is set) and checkpoint through `wrap_checkpoint(their checkpoint function)`. Both are
    restored on exit.
    """
    saved = [(vars(layer).get("_can_checkpoint_with_cache"), layer._gradient_checkpointing_func) for layer in layers]
    try:
        for layer in layers:
            layer._can_checkpoint_with_cache = True
            layer._gradient_checkpointing_func = wrap_checkpoint(layer._gradient_checkpointing_func)
        yield
    finally:
        for layer, (can_checkpoint, checkpoint_function) in zip(layers, saved):
            if can_checkpoint is None:
                del layer._can_checkpoint_with_cache
            else:
                layer._can_checkpoint_with_cache = can_checkpoint
            layer._gradient_checkpointing_func = checkpoint_function


@contextmanager
def checkpointing_paused(layer: GradientCheckpointingLayer) -> Iterator[None]:
    """Within the block, `layer`'s own `forward` does not checkpoint: transformers (5.25) wraps a checkpointing
    layer's `forward` itself in the checkpoint, not only its `__call__`."""
    enabled = layer.gradient_checkpointing
    try:
        layer.gradient_checkpointing = False
        yield
    finally:
        layer.gradient_checkpointing = enabled


def resolved_generation_config(model: PreTrainedModel, kwargs: dict[str, Any]) -> Any:
    """The generation config `model.generate(**kwargs)` would use, resolved and validated by transformers' own code
    (`_prepare_generation_config`), e.g. refusing `max_new_tokens=0`."""
    others = {key: value for key, value in kwargs.items() if key != "generation_config"}
    generation_config, _ = model._prepare_generation_config(kwargs.get("generation_config"), **others)
    return generation_config


def inferred_attention_mask(model: PreTrainedModel, input_ids: Any, generation_config: Any) -> Any:
    """The attention mask `generate` infers when none is given (0 on `pad_token_id`, unless the pad token is also an
    end-of-sequence token), by transformers' own code, with its warnings."""
    generation_config = copy.deepcopy(generation_config)
    model._prepare_special_tokens(
        generation_config, kwargs_has_attention_mask=False, device=input_ids.device, batch_size=input_ids.shape[0]
    )
    return model._prepare_attention_mask_for_generation(input_ids, generation_config, {})


def keep_one_more_sliding_position(cache: Any) -> None:
    """
    Make each sliding-window layer of a new, empty generation cache keep `sliding_window` past positions instead of
    transformers' `sliding_window - 1`, by replacing it with a `DynamicSlidingWindowLayer` of a window one wider.

    `DynamicSlidingWindowLayer` keeps what a causal query can reach (`kv > q - sliding_window`), but transformers'
    bidirectional sliding mask reaches one position further (`|q - kv| <= sliding_window`), and the bidirectional
    prompt pass of a continued conversation reads the generation cache. The masks themselves come from the config's
    `sliding_window`, so the extra position is masked out of every causal step.
    """
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            if layer.is_initialized:
                raise RuntimeError("Only an empty cache's sliding-window layers can be widened.")
            cache.layers[index] = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window + 1)


def attention_implementation(model: PreTrainedModel) -> str:
    """The attention implementation the model runs with (`config._attn_implementation`), e.g. "sdpa" or "eager"."""
    return model.config._attn_implementation


# transformers' hooks for `output_attentions`/`output_hidden_states`: idle unless those are asked for.
_OUTPUT_CAPTURING_HOOKS = "transformers.utils.output_capturing"


# ------------------------------------------------------------------------------------------------------------ PEFT
def route_layers(layers: Sequence[BaseTunerLayer], adapter_names: list[str]) -> None:
    """
    Make `adapter_names` the active adapters of each tuner layer, without touching `requires_grad` (PEFT's
    `set_adapter` freezes the others, and both weight sets must keep training). The one list is shared by all layers:
    PEFT replaces a layer's list, never mutates it.
    """
    for layer in layers:
        layer._active_adapter = adapter_names


def routed_adapters(layer: BaseTunerLayer) -> list[str]:
    """The active adapters of a tuner layer, as `route_layers` set them."""
    return layer._active_adapter


def routes_rows(layer: BaseTunerLayer) -> bool:
    """Whether a tuner layer runs each row with its own adapter when its forward is handed `adapter_names` (PEFT's
    mixed batches: LoRA's `_mixed_batch_forward`, which refuses DoRA adapters)."""
    return hasattr(layer, "_mixed_batch_forward") and not any(getattr(layer, "use_dora", {}).values())


def add_peft_type(name: str) -> PeftType:
    """
    Add `name` to PEFT's `PeftType` enum (a `str` enum), the way the enum machinery builds its own members.

    PEFT has no plugin discovery: `register_peft_method` only accepts names that are already members of the closed
    enum, and PEFT and transformers call `peft_type.value`, so a plain string key is not enough.
    """
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    member.__init__(name)
    # Set the class attribute before the member maps: `EnumType.__setattr__` refuses to rebind names it knows.
    setattr(PeftType, name, member)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    return member


def tuner_state(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The entries of `state_dict` that live on the tuner and its layers, found structurally as PEFT's own saving
    does (`_get_tuner_state_dict_key_prefixes`)."""
    return _filter_state_dict_by_key_prefixes(state_dict, _get_tuner_state_dict_key_prefixes(model))


def hub_kwargs(config_cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Hub arguments (`revision`, `cache_dir`, `token`, ...) among `PeftConfig.from_pretrained`'s `kwargs`, split
    off by PEFT's own `_split_kwargs`."""
    hub_arguments, _, _ = config_cls._split_kwargs(kwargs)
    return hub_arguments


# The `BaseTuner` methods and attributes `BituneModel` and its checkpoint hooks override: PEFT calls them by these
# names, so if one is renamed, the override is silently never called.
OVERRIDDEN_TUNER_HOOKS = (
    "inject_adapter",
    "set_adapter",
    "delete_adapter",
    "set_requires_grad",
    "enable_adapter_layers",
    "disable_adapter_layers",
    "_mark_only_adapters_as_trainable",
    "_cast_adapter_dtype",
    "_prepare_adapter_config",
    "_check_target_module_exists",
    "_create_and_replace",
    "_check_merge_allowed",
    "supports_lora_conversion",
    "_get_adapter_state_dict",
    "_remove_adapter_name_from_key",
    "_remap_adapter_state_dict_for_load",
    "_get_learnable_bias_state_dict",
    "uses_shared_state",
)


# ------------------------------------------------------------------------------------------------ torch, accelerate
def is_fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP (1 or 2) manages `module`'s parameters (torch marks such modules `_is_fsdp_managed_module`).
    Read from the instance dict: a missing attribute costs an exception in `nn.Module.__getattr__`."""
    return bool(vars(module).get("_is_fsdp_managed_module", False))


def forwards_are_hooked(modules: Sequence[nn.Module]) -> bool:
    """Whether anything runs around the forwards of `modules`: forward hooks (FSDP2, DeepSpeed, the user's), global
    forward hooks, accelerate hooks (`_hf_hook`: offloading, device maps), FSDP management. transformers' idle
    output-capturing hooks do not count."""

    def active(hooks: dict) -> bool:
        return bool(hooks) and any(
            getattr(hook, "__module__", None) != _OUTPUT_CAPTURING_HOOKS for hook in hooks.values()
        )

    module_globals = nn.modules.module
    if active(getattr(module_globals, "_global_forward_hooks", {})) or active(
        getattr(module_globals, "_global_forward_pre_hooks", {})
    ):
        return True
    for module in modules:
        if vars(module).get("_hf_hook") is not None or is_fsdp_managed(module):
            return True
        if active(module._forward_hooks) or active(module._forward_pre_hooks):
            return True
    return False


def autocast_state(device_type: str) -> Any:
    """The autocast state now, of `device_type` and of the CPU alike, as `torch.utils.checkpoint` records it for a
    recomputation (its private `_get_autocast_kwargs`); `autocast_restored` enters it again."""
    from torch.utils import checkpoint

    return device_type, checkpoint._get_autocast_kwargs(device_type)


@contextmanager
def autocast_restored(state: Any) -> Iterator[None]:
    """Within the block, autocast as `autocast_state` found it (the device's and the CPU's), entered as torch's
    checkpoint recomputation enters it."""
    import torch

    device_type, (device_kwargs, cpu_kwargs) = state
    device_autocast = (torch.amp.autocast(device_type, **device_kwargs) if device_kwargs is not None
                       else contextlib.nullcontext())
    with device_autocast, torch.amp.autocast("cpu", **cpu_kwargs):
        yield


# ---------------------------------------------------------------------------------------------------- bitsandbytes
def bitsandbytes_4bit_layers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The bitsandbytes 4-bit linear layers among `modules`. bitsandbytes is only looked for among the imported
    modules: a model with 4-bit layers has imported it, and importing it otherwise costs seconds."""
    bitsandbytes = sys.modules.get("bitsandbytes")
    if bitsandbytes is None:
        return []
    return [module for module in modules if isinstance(module, bitsandbytes.nn.Linear4bit)]


def is_repacked_for_cpu_inference(layer: nn.Module) -> bool:
    """Whether bitsandbytes has repacked a 4-bit layer's weight for its bf16 CPU inference kernel: it then marks the
    weight's `quant_state` with `packing_format_for_cpu`."""
    state = getattr(layer.weight, "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


def keep_out_of_cpu_inference_layout(layer: nn.Module) -> None:
    """Stop bitsandbytes from repacking a 4-bit layer for CPU inference: `Linear4bit.forward` repacks (in eval mode,
    without gradients) when the instance attribute `support_avx512bf16_for_cpu`, set in its `__init__` from the CPU's
    features, is true. Releases without the repacking do not read it."""
    layer.support_avx512bf16_for_cpu = False


# ------------------------------------------------------------------------------------------------------------- TRL
def without_launcher_arguments(argv: list[str], launcher_arguments: list[str]) -> list[str]:
    """`argv` less `launcher_arguments` (an ordered subsequence of it, those `accelerate launch` takes): the training
    script's arguments, split as `trl sft` splits them (`trl.cli.commands.training._subtract_subsequence`)."""
    from trl.cli.commands.training import _subtract_subsequence

    return _subtract_subsequence(argv, launcher_arguments)

"""`BituneModel`: the PEFT tuner of Bitune adapters. Its own code is the adapters' lifecycle.

It creates the two weight sets of each adapter in the inner PEFT method and the mixing scalars, switches, deletes,
freezes and unfreezes adapters, and refuses what a Bitune adapter cannot do (merging, weighted combination). The rest
is mixed in or held: the training forward (`forward.py`), generation (`generation.py`), checkpoint keys
(`persistence.py`), and the routing of the layers to one weight set per pass (`routing.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn

from ..constants import (
    BIDIRECTIONAL,
    BITUNE_PREFIX,
    CAUSAL,
    INNER_SEPARATOR,
    MIXERS_ATTRIBUTE,
    WEIGHT_SETS,
    WeightSet,
    inner_adapter_name,
)
from ..persistence.base_model_records import match_base_model
from ..persistence.checkpoint_keys import BituneCheckpointMixin
from ..utils.model_config import num_layers
from .checks import check_base_model_supported
from .config import BituneConfig
from .forward import BituneForwardMixin
from .generation import BituneGenerationMixin
from .mixing import BituneKVMixer
from .passes import BitunePasses
from .quantization import check_quantized_base, prepare_quantized_layers
from .routing import LayerRouter


class BituneModel(BituneCheckpointMixin, BituneForwardMixin, BituneGenerationMixin, BaseTuner):
    """
    Bitune (bidirectional instruction tuning) on top of any PEFT method that supports several adapters.

    The inner method (LoRA by default) holds two weight sets per Bitune adapter, `"<name>__causal"` and
    `"<name>__bidirectional"`; the tuner itself holds the per-layer mixing scalars. A training forward reads the
    instruction twice (bidirectional and causal weights), mixes the two key/value caches and runs the answer causally
    over the mix: see `passes.py`. Each pass runs with its weight set through `routing.py`.

    Args:
        model (`transformers.PreTrainedModel`): a decoder-only causal LM with a KV cache.
        config (`BituneConfig` or `dict[str, BituneConfig]`): the adapter configuration.
        adapter_name (`str`): name of the Bitune adapter, `"default"` by default.
    """

    prefix: str = BITUNE_PREFIX
    tuner_layer_cls = BaseTunerLayer
    target_module_mapping: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ construction
    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Create the weight sets of `adapter_name` in the inner PEFT method, and its mixing scalars."""
        config: BituneConfig = self.peft_config[adapter_name]
        if not isinstance(config, BituneConfig):
            raise TypeError(f"BituneModel holds only Bitune adapters; `{adapter_name}` has a {type(config).__name__}.")
        config.check()  # first: a field assigned after the config was made is refused by name, before any use
        check_base_model_supported(model)
        check_quantized_base(model, config.adapter_config)
        match_base_model(config, model, adapter_name)
        if INNER_SEPARATOR in adapter_name:
            raise ValueError(f"Bitune adapter names cannot contain '{INNER_SEPARATOR}', got `{adapter_name}`.")
        inner = self.__dict__.get("_inner_tuner")
        if inner is not None and type(inner) is not PEFT_TYPE_TO_TUNER_MAPPING[config.adapter_config.peft_type]:
            raise ValueError(
                f"All Bitune adapters of one model must use the same PEFT method; this model uses "
                f"{type(inner).__name__}, and `{adapter_name}` asks for {config.adapter_config.peft_type}."
            )
        config.check_depth(num_layers(model))
        prepare_quantized_layers(model)
        for weight_set in config.weight_sets:
            name = inner_adapter_name(adapter_name, weight_set)
            inner_config = copy.deepcopy(config.adapter_config)
            inner_config.inference_mode = config.inference_mode
            if inner is None:
                tuner_cls = PEFT_TYPE_TO_TUNER_MAPPING[inner_config.peft_type]
                inner = tuner_cls(model, {name: inner_config}, name, low_cpu_mem_usage=low_cpu_mem_usage)
                # Kept out of the module tree: it wraps the same `model`, whose parameters must be registered once.
                self.__dict__["_inner_tuner"] = inner
            else:
                inner.peft_config[name] = inner_config
                inner.inject_adapter(
                    model, name, autocast_adapter_dtype=autocast_adapter_dtype, low_cpu_mem_usage=low_cpu_mem_usage
                )
        self._router.forget()
        if MIXERS_ATTRIBUTE not in dict(self.named_children()):
            self.add_module(MIXERS_ATTRIBUTE, nn.ModuleDict())
        device = next(p.device for p in model.parameters())
        self.bitune_mixers[adapter_name] = BituneKVMixer(
            num_layers(model), config.mix_init, config.mix_scale, mixed_layers=config.mixed_layers
        ).to(device)
        self._router.route_to(self._inner_names(self.active_adapter)[CAUSAL])
        self._apply_trainable_state()

    def _inner_names(self, adapter_name: str) -> dict[WeightSet, str]:
        """Inner adapter used by each pass; with shared weights both passes use the causal set."""
        config = self.peft_config[adapter_name]
        causal = inner_adapter_name(adapter_name, CAUSAL)
        bidirectional = causal if config.shared_weights else inner_adapter_name(adapter_name, BIDIRECTIONAL)
        return {CAUSAL: causal, BIDIRECTIONAL: bidirectional}

    def _apply_trainable_state(self) -> None:
        """Only the active adapter trains (as with PEFT's `set_adapter`): both its weight sets and its mixing
        scalars."""
        for adapter_name, config in self.peft_config.items():
            trainable = adapter_name == self.active_adapter and not config.inference_mode
            names = set(self._inner_names(adapter_name).values())
            for layer in self._router.index.tuner_layers:
                for attribute in layer.adapter_layer_names:
                    for key, module in getattr(layer, attribute).items():
                        if key in names:
                            module.requires_grad_(trainable)
            self.bitune_mixers[adapter_name].requires_grad_(trainable and config.train_mixing)

    @property
    def _router(self) -> LayerRouter:
        """Routes the model's layers to a weight set (see `routing.py`); made once per model, kept out of the module
        tree."""
        router = self.__dict__.get("_layer_router")
        if router is None or router.model is not self.model:
            router = self.__dict__["_layer_router"] = LayerRouter(self.model)
        return router

    @contextmanager
    def weights(self, weight_set: WeightSet) -> Iterator[None]:
        """Run the model with one weight set of the active adapter; restores the previous routing on exit."""
        if weight_set not in WEIGHT_SETS:
            raise ValueError(f"`weight_set` must be one of {WEIGHT_SETS}, got {weight_set!r}.")
        with self._router.routed_to(self._inner_names(self.active_adapter)[weight_set]):
            yield

    # ------------------------------------------------------------------ state
    @property
    def mixer(self) -> BituneKVMixer:
        """The mixing scalars of the active adapter."""
        return self.bitune_mixers[self.active_adapter]

    def get_mixing_coefficients(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The alphas of an adapter (the active one by default): `{"keys": (num_layers,), "values": (num_layers,)}`,
        detached, float32."""
        adapter_name = self.active_adapter if adapter_name is None else adapter_name
        self._check_adapter_exists(adapter_name)
        key_alpha, value_alpha = self.bitune_mixers[adapter_name].coefficients()
        return {"keys": key_alpha.detach(), "values": value_alpha.detach()}

    def _check_adapter_exists(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter `{adapter_name}` not found; available: {sorted(self.peft_config)}.")

    def _adapters_disabled(self) -> bool:
        return any(layer.disable_adapters for layer in self._router.index.tuner_layers)

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        """Make `adapter_name` the active Bitune adapter (one at a time: two Bitune adapters cannot be combined)."""
        if isinstance(adapter_name, (list, tuple)):
            if len(adapter_name) != 1:
                raise ValueError(
                    f"Only one Bitune adapter can be active at a time, got {list(adapter_name)}: each brings its own "
                    "prompt passes and mixing, which do not add up."
                )
            adapter_name = adapter_name[0]
        self._check_adapter_exists(adapter_name)
        self.active_adapter = adapter_name
        if inference_mode:
            self.peft_config[adapter_name].inference_mode = True
        self._router.route_to(self._inner_names(adapter_name)[CAUSAL])
        self._apply_trainable_state()

    def delete_adapter(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter `{adapter_name}` does not exist.")
        if adapter_name == self.active_adapter and len(self.peft_config) == 1:
            raise ValueError("Cannot delete the only Bitune adapter of the model; unload the model instead.")
        for name in set(self._inner_names(adapter_name).values()):
            self._inner_tuner.delete_adapter(name)
        self._router.forget()
        del self.bitune_mixers[adapter_name]
        del self.peft_config[adapter_name]
        if adapter_name == self.active_adapter:
            self.set_adapter(next(iter(self.peft_config)))
        else:
            self._router.route_to(self._inner_names(self.active_adapter)[CAUSAL])

    def set_requires_grad(self, adapter_names: str | list[str], requires_grad: bool = True) -> None:
        """Enable or disable the gradients of Bitune adapters: both weight sets, and the mixing scalars unless the
        adapter was configured with `train_mixing=False`. (PEFT's own version looks for the Bitune name on the layers,
        which hold the inner names, and would change nothing.)"""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        unknown = sorted(set(names) - set(self.peft_config))
        if unknown:
            raise ValueError(f"Adapters {unknown} not found; available: {sorted(self.peft_config)}.")
        for name in names:
            inner_names = sorted(set(self._inner_names(name).values()))
            for layer in self._router.index.tuner_layers:
                layer.set_requires_grad(adapter_names=inner_names, requires_grad=requires_grad)
            self.bitune_mixers[name].requires_grad_(requires_grad and self.peft_config[name].train_mixing)

    def enable_adapter_layers(self) -> None:
        """Enable the adapters again. PEFT re-activates each layer's routed adapter only, which would leave the
        bidirectional weight set frozen for good; both weight sets and the mixing scalars train again instead."""
        super().enable_adapter_layers()
        self._router.route_to(self._inner_names(self.active_adapter)[CAUSAL])
        self._apply_trainable_state()

    def disable_adapter_layers(self) -> None:
        """Disable the adapters (the model is then the base model); like PEFT, nothing of the adapters trains."""
        super().disable_adapter_layers()
        self.bitune_mixers.requires_grad_(False)

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        self._inner_tuner._mark_only_adapters_as_trainable(model)
        self._apply_trainable_state()

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        for name in set(self._inner_names(adapter_name).values()):
            self._inner_tuner._cast_adapter_dtype(name, autocast_adapter_dtype=autocast_adapter_dtype)

    def _prepare_adapter_config(self, peft_config: BituneConfig, model_config: dict) -> BituneConfig:
        return peft_config

    def _check_target_module_exists(self, peft_config: BituneConfig, key: str) -> bool:
        raise NotImplementedError("BituneModel delegates module targeting to its inner PEFT method.")

    def _create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("BituneModel delegates module replacement to its inner PEFT method.")

    def _check_merge_allowed(self) -> None:
        raise ValueError(
            "A Bitune adapter cannot be merged into the base model: it holds two weight sets that are used for "
            "different tokens (the bidirectional set only while reading the prompt, the causal set everywhere else), "
            "plus a learned mix of the two prompt caches. No single set of merged weights reproduces that. Keep the "
            "adapter unmerged and use `model.generate`, which already decodes at the cost of the base model plus one "
            "adapter."
        )

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        self._check_merge_allowed()

    def merge_adapter(self, *args: Any, **kwargs: Any) -> None:
        self._check_merge_allowed()

    def add_weighted_adapter(self, *args: Any, **kwargs: Any) -> None:
        """Refused: see the message. (Without this, PEFT's lookup falls through to the base model's AttributeError.)"""
        raise ValueError(
            "Bitune adapters cannot be combined with `add_weighted_adapter`: each holds two weight sets used for "
            "different tokens (the bidirectional set only while reading the prompt) and mixing scalars trained "
            "together with them, and a weighted sum of two adapters' weight sets and scalars is not an adapter "
            "either was trained as. Switch between adapters with `set_adapter`, or train one Bitune adapter on the "
            "combined data."
        )

    # ------------------------------------------------------------------ passes
    def _passes(self) -> BitunePasses:
        """The passes of a forward of the active adapter, as the model is wrapped now."""
        return BitunePasses(
            model=self.model,
            weights=self.weights,
            mixer=self.mixer,
            second_pass_attention=self.peft_config[self.active_adapter].second_pass_attention,
            stop_early=self._router.prompt_passes_may_stop_early(),
            decoder_layer_paths=self._router.index.decoder_layer_paths,
        )

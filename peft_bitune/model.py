"""`BituneModel`: the PEFT tuner of Bitune adapters, i.e. PEFT's bookkeeping around the passes of `passes.py`.

It creates the two weight sets of each adapter in the inner PEFT method and the mixing scalars, routes the layers to
one weight set per pass, keeps the right weights trainable, refuses what a Bitune adapter cannot do (merging,
weighted combination), checks the training forward's input before any compute, and hands it to `BitunePasses`.
Saving and loading are in `persistence.py`, generation in `generation.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import compat
from .common import (
    BIDIRECTIONAL,
    BITUNE_PREFIX,
    CAUSAL,
    INNER_SEPARATOR,
    MIXERS_ATTRIBUTE,
    WEIGHT_SETS,
    WeightSet,
    inner_adapter_name,
    max_positions,
    num_layers,
    text_config,
)
from .config import BituneConfig
from .generation import BituneGenerationMixin
from .inputs import check_training_arguments
from .layout import ConversationLayout
from .mixing import BituneKVMixer
from .passes import BitunePasses, answer_loss, decoder_of
from .persistence import BituneCheckpointMixin
from .quantization import check_quantized_base, prepare_quantized_layers
from .sharding import LayerPath, check_sharding


class BituneModel(BituneCheckpointMixin, BituneGenerationMixin, BaseTuner):
    """
    Bitune (bidirectional instruction tuning) on top of any PEFT method that supports several adapters.

    The inner method (LoRA by default) holds two weight sets per Bitune adapter, `"<name>__causal"` and
    `"<name>__bidirectional"`; the tuner itself holds the per-layer mixing scalars. A training forward reads the
    instruction twice (bidirectional and causal weights), mixes the two key/value caches and runs the answer causally
    over the mix: see `passes.py`.

    Passes are routed to their weights through the layers' active adapter, inside a context manager that restores it;
    `requires_grad` is never touched there, so both weight sets always train.

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
        _check_model_supported(model)
        check_quantized_base(model, config.adapter_config)
        if INNER_SEPARATOR in adapter_name:
            raise ValueError(f"Bitune adapter names cannot contain '{INNER_SEPARATOR}', got `{adapter_name}`.")
        inner = self.__dict__.get("_inner_tuner")
        if inner is not None and type(inner) is not PEFT_TYPE_TO_TUNER_MAPPING[config.adapter_config.peft_type]:
            raise ValueError(
                f"All Bitune adapters of one model must use the same PEFT method; this model uses "
                f"{type(inner).__name__}, and `{adapter_name}` asks for {config.adapter_config.peft_type}."
            )
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
        self._forget_module_index()
        if MIXERS_ATTRIBUTE not in dict(self.named_children()):
            self.add_module(MIXERS_ATTRIBUTE, nn.ModuleDict())
        device = next(p.device for p in model.parameters())
        self.bitune_mixers[adapter_name] = BituneKVMixer(num_layers(model), config.mix_init, config.mix_scale).to(
            device
        )
        self._route_layers_to(self._inner_names(self.active_adapter)[CAUSAL])
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
            for layer in self._tuner_layers():
                for attribute in layer.adapter_layer_names:
                    for key, module in getattr(layer, attribute).items():
                        if key in names:
                            module.requires_grad_(trainable)
            self.bitune_mixers[adapter_name].requires_grad_(trainable and config.train_mixing)

    def _module_index(self) -> _ModuleIndex:
        """The model's tuner and checkpointing layers, found once: walking the whole module tree several times per
        step costs more than the routing itself on deep models. Rebuilt whenever adapters are added or deleted."""
        index = self.__dict__.get("_module_index_cache")
        if index is None:
            index = _ModuleIndex.of(self.model)
            self.__dict__["_module_index_cache"] = index
        return index

    def _forget_module_index(self) -> None:
        self.__dict__.pop("_module_index_cache", None)

    def _tuner_layers(self) -> tuple[BaseTunerLayer, ...]:
        return self._module_index().tuner_layers

    # ------------------------------------------------------------------ routing
    def _route_layers_to(self, inner_name: str) -> None:
        compat.route_layers(self._tuner_layers(), [inner_name])

    @contextmanager
    def _routed_to(self, inner_name: str) -> Iterator[None]:
        layers = self._tuner_layers()
        previous = [compat.routed_adapters(layer) for layer in layers]
        try:
            compat.route_layers(layers, [inner_name])
            yield
        finally:
            for layer, active in zip(layers, previous):
                compat.route_layers([layer], active)

    @contextmanager
    def weights(self, weight_set: WeightSet) -> Iterator[None]:
        """Run the model with one weight set of the active adapter; restores the previous routing on exit."""
        if weight_set not in WEIGHT_SETS:
            raise ValueError(f"`weight_set` must be one of {WEIGHT_SETS}, got {weight_set!r}.")
        with self._routed_to(self._inner_names(self.active_adapter)[weight_set]):
            yield

    @contextmanager
    def _checkpointing_keeps_caches(self) -> Iterator[None]:
        """
        Make gradient checkpointing work across the three passes.

        transformers drops caches in checkpointed layers; ours are safe to keep because they are idempotent (prompt
        passes overwrite their record, the answer pass stores nothing). A layer is recomputed during backward, after
        its pass has ended, so the recomputation is told to run under the weights of the pass that first ran it.
        Reentrant checkpointing silently loses the key/value projections' gradients, so it is refused.
        """
        checkpointing = self._checkpointing_layers()
        if not checkpointing:
            yield
            return
        if any(compat.uses_reentrant_checkpointing(layer) for layer in checkpointing):
            raise ValueError(
                "Bitune needs non-reentrant gradient checkpointing (reentrant checkpointing drops the gradients "
                "of the key/value projections that flow through the mixed cache). Enable it with "
                f"{compat.checkpointing_hint()}. (PEFT's `prepare_model_for_kbit_training` turns on reentrant "
                "checkpointing unless given `gradient_checkpointing_kwargs={'use_reentrant': False}`.)"
            )
        with compat.checkpointed_layers_keep_caches(checkpointing, self._recompute_with_same_weights):
            yield

    def _prompt_passes_may_stop_early(self) -> bool:
        """
        Whether a prompt pass may end as soon as the last layer has recorded its keys/values (`PromptPassComplete`).

        Leaving the decoder by an exception skips whatever was to run after the forwards it leaves. So the passes run
        to the end under gradient checkpointing (a checkpointed layer's recomputation state would be left to the
        garbage collector) and whenever something hooks into the decoder forwards the stop leaves or skips (all but
        those of the earlier layers, which finish): accelerate (offloading, device maps), FSDP, DeepSpeed ZeRO-3 or the
        user's own hooks. Only those modules are checked: a walk of the whole model costs milliseconds on deep models.
        """
        if self._checkpointing_layers():
            return False
        return not compat.forwards_are_hooked(self._module_index().early_exit_path)

    def _checkpointing_layers(self) -> list[GradientCheckpointingLayer]:
        """The layers that will checkpoint in this forward (checkpointing enabled, training mode)."""
        return [m for m in self._module_index().checkpoint_layers if m.gradient_checkpointing and m.training]

    def _recompute_with_same_weights(self, checkpoint_func: Any) -> Any:
        def checkpoint_in_pass(function: Any, *args: Any, **kwargs: Any) -> Any:
            routed = compat.routed_adapters(self._tuner_layers()[0])[0]
            if "context_fn" in kwargs:
                raise ValueError(
                    "Bitune sets the checkpoint `context_fn` itself; remove it from the checkpoint kwargs."
                )
            return checkpoint_func(
                function, *args, context_fn=lambda: (nullcontext(), self._routed_to(routed)), **kwargs
            )

        return checkpoint_in_pass

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
        return any(layer.disable_adapters for layer in self._tuner_layers())

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
        self._route_layers_to(self._inner_names(adapter_name)[CAUSAL])
        self._apply_trainable_state()

    def delete_adapter(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter `{adapter_name}` does not exist.")
        if adapter_name == self.active_adapter and len(self.peft_config) == 1:
            raise ValueError("Cannot delete the only Bitune adapter of the model; unload the model instead.")
        for name in set(self._inner_names(adapter_name).values()):
            self._inner_tuner.delete_adapter(name)
        self._forget_module_index()
        del self.bitune_mixers[adapter_name]
        del self.peft_config[adapter_name]
        if adapter_name == self.active_adapter:
            self.set_adapter(next(iter(self.peft_config)))
        else:
            self._route_layers_to(self._inner_names(self.active_adapter)[CAUSAL])

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
            for layer in self._tuner_layers():
                layer.set_requires_grad(adapter_names=inner_names, requires_grad=requires_grad)
            self.bitune_mixers[name].requires_grad_(requires_grad and self.peft_config[name].train_mixing)

    def enable_adapter_layers(self) -> None:
        """Enable the adapters again. PEFT re-activates each layer's routed adapter only, which would leave the
        bidirectional weight set frozen for good; both weight sets and the mixing scalars train again instead."""
        super().enable_adapter_layers()
        self._route_layers_to(self._inner_names(self.active_adapter)[CAUSAL])
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

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """
        The Bitune training forward.

        Args:
            input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): instruction then answer, padded left or
                right.
            attention_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on real tokens.
            inputs_embeds (`torch.FloatTensor` of shape (batch_size, seq_len, hidden_size), *optional*): instead of
                ids.
            labels (`torch.LongTensor` of shape (batch_size, seq_len), *optional*): targets aligned with the input,
                -100 where there is no loss. Without `prompt_mask`, the instruction is the unsupervised tokens before
                the first supervised one.
            prompt_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on instruction tokens. When
                given, labels on instruction tokens are not used: the loss is on answer tokens only.
            cache (`Cache`, *optional*): continue decoding from a cache (e.g. from `prefill`); the input is then run
                causally with the causal weights, exactly like a decoding step of `generate`. `past_key_values`, its
                name before transformers 5.24, is accepted too.
            num_items_in_batch (`int`, *optional*): the number of supervised tokens the loss is averaged over (passed
                by `Trainer` under gradient accumulation); defaults to this batch's count.
            kwargs: other arguments of the model's forward. The three passes cover different parts of each row, so
                none is handed on: `position_ids` are accepted when they are the ordinary positions every pass uses
                anyway (0, 1, ... over each row's real tokens), `logits_to_keep` when 0; anything else (e.g. packed
                `position_ids`, `cache_position`, `token_type_ids`) is refused by name before any compute.

        Returns:
            `CausalLMOutputWithPast` whose `logits` (batch_size, seq_len, vocab) are aligned with the input. Positions
            before the last instruction token hold zeros: their logits are never used, and the LM head over a long
            prompt with a large vocabulary is not free.
        """
        kwargs[compat.NEW_CACHE_NAME] = cache
        cache = compat.pop_cache(kwargs)  # `cache`, or its old name `past_key_values`
        if self._adapters_disabled():
            return self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                labels=labels,
                **compat.with_cache(self.model, cache),
                **kwargs,
            )
        if cache is not None:
            if prompt_mask is not None or labels is not None:
                raise ValueError(
                    "`cache` continues a sequence causally, so it cannot be combined with `labels` or `prompt_mask` "
                    "(a new instruction on top of a cache is multi-turn data, not supported yet)."
                )
            return self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                **compat.with_cache(self.model, cache),
                **kwargs,
            )
        for unsupported in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(unsupported, None):
                raise NotImplementedError(
                    f"`{unsupported}=True` is not supported by the Bitune forward, whose three passes have different "
                    "lengths; see `peft_bitune.visualize` for attention maps."
                )
        kwargs.pop("return_dict", None)
        kwargs.pop("use_cache", None)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        sequence = input_ids if input_ids is not None else inputs_embeds
        if 0 in sequence.shape[:2]:
            raise ValueError(
                f"The batch is empty (input of shape {tuple(sequence.shape)}): give at least one row of at least one "
                "token."
            )
        check_training_arguments(kwargs, sequence.shape[:2], attention_mask, max_positions(self.model))
        layout = ConversationLayout.from_inputs(
            sequence.shape,
            attention_mask,
            labels,
            prompt_mask,
            device=sequence.device,
            mode=self.peft_config[self.active_adapter].multi_turn,
        )
        check_sharding(self._module_index().decoder_layer_paths, num_layers(self.model), self.mixer)
        with self._checkpointing_keeps_caches():
            answer_logits = self._passes().run_layout(layout, sequence)
        loss = None
        if labels is not None:
            loss = answer_loss(answer_logits, [turn.answer.labels for turn in layout.turns], num_items_in_batch)
        logits = layout.scatter_answers(answer_logits, sequence.shape[0], sequence.shape[1])
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _passes(self) -> BitunePasses:
        """The passes of a forward of the active adapter, as the model is wrapped now."""
        return BitunePasses(
            model=self.model,
            weights=self.weights,
            mixer=self.mixer,
            second_pass_attention=self.peft_config[self.active_adapter].second_pass_attention,
            stop_early=self._prompt_passes_may_stop_early(),
            decoder_layer_paths=self._module_index().decoder_layer_paths,
        )


@dataclass(frozen=True)
class _ModuleIndex:
    """The modules of the base model that Bitune touches on every pass."""

    tuner_layers: tuple[BaseTunerLayer, ...]
    checkpoint_layers: tuple[GradientCheckpointingLayer, ...]
    # The decoder's modules that a prompt pass stopped at the last layer's keys/values leaves early or skips: all but
    # those inside the earlier decoder layers, which finish before it stops.
    early_exit_path: tuple[nn.Module, ...]
    # Where each decoder layer sits in the model, in layer order: FSDP units and wrappers are found along these.
    decoder_layer_paths: tuple[LayerPath, ...]

    @classmethod
    def of(cls, model: nn.Module) -> _ModuleIndex:
        modules = list(model.modules())
        decoder = decoder_of(model)
        decoder_layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
        finished = {id(m) for layer in decoder_layers[:-1] for m in layer.modules()}
        layer_names = {id(m): name for name, m in model.named_modules()}
        return cls(
            tuple(m for m in modules if isinstance(m, BaseTunerLayer)),
            tuple(m for m in modules if isinstance(m, GradientCheckpointingLayer)),
            tuple(m for m in decoder.modules() if id(m) not in finished),
            tuple(LayerPath.of(model, layer_names[id(layer)]) for layer in decoder_layers),
        )


def _check_model_supported(model: nn.Module) -> None:
    """Refuse, before any weights are created, a model Bitune cannot run on."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate") or not hasattr(model, "get_decoder"):
        raise ValueError(
            f"Bitune needs a transformers causal language model (e.g. `AutoModelForCausalLM`), got "
            f"{type(model).__name__}."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"Bitune tunes decoder-only models; {type(model).__name__} is an encoder-decoder model."
        )
    if getattr(text_config(model), "use_cache", None) is None:
        raise ValueError(
            f"Bitune reads the prompt into a KV cache, and {type(model).__name__} has no KV cache support."
        )
    if not hasattr(text_config(model), "num_hidden_layers"):
        raise ValueError(f"Cannot find `num_hidden_layers` in the config of {type(model).__name__}.")


def find_bitune_tuner(model: nn.Module) -> BituneModel | None:
    """The `BituneModel` of `model`: the tuner itself, the one inside a Bitune `PeftModel`, or the one inside a model
    wrapped by DDP, FSDP or accelerate. `None` if there is none; callers say what they needed it for."""
    if isinstance(model, BituneModel):
        return model
    base_model = getattr(model, "base_model", None)
    if isinstance(base_model, BituneModel):
        return base_model
    return next((module for module in model.modules() if isinstance(module, BituneModel)), None)

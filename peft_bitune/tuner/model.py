"""`BituneModel`: the PEFT tuner of Bitune adapters, in one class.

Its own code is the adapters' lifecycle: it creates the two weight sets of each adapter in the inner PEFT method and
the mixing scalars, switches, deletes, freezes and unfreezes adapters, and refuses what a Bitune adapter cannot do
(merging, weighted combination). Its `forward`, `prefill` and `generate` check what they are given once
(`checks.py`) and hand the checked value on: to the passes (`layout.py`, `passes.py`) and to generation
(`generation.py`). Its checkpoint hooks, which PEFT calls, map keys through `persistence/checkpoint_keys.py`.

The route of the inputs through these modules is in the package's docstring (`tuner/__init__.py`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import compat
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
from ..persistence.checkpoint_keys import checkpoint_key, loaded_adapter_state, saved_adapter_state
from ..utils.base_model import has_sliding_window_layers, max_positions, num_layers
from . import adapter_batches, generation
from .adapter_batches import RowAdapters
from .caches import BituneCache
from .checks import (
    Prompts,
    check_base_model_supported,
    check_continuation_arguments,
    check_generation_fits,
    check_prompts,
    check_token_ids,
    check_training_inputs,
)
from .config import BituneConfig
from .fused_head import (
    check_fused_call,
    check_rows_to_read,
    ensure_fused_head,
    fused_output,
    warn_reference_without_adapter,
)
from .layout import ConversationLayout
from .mixing import BituneKVMixer
from .packing import check_packing_supported
from .passes import BitunePasses, answer_loss
from .quantization import check_quantized_base, prepare_quantized_layers
from .routing import LayerRouter, one_call_at_a_time
from .sharding import check_sharding


class BituneModel(BaseTuner):
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
    # The mixing scalars live on the tuner, not on the layers. PEFT's `inject_adapter_in_model` (used by transformers'
    # own adapter loading: `model.load_adapter(path)`, `AutoModelForCausalLM.from_pretrained(<adapter>)`) keeps only
    # the layers and would run the causal weights alone; this flag makes it refuse.
    uses_shared_state: bool = True

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
        check_base_model_supported(model, config.second_pass_attention)
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
        mixer = BituneKVMixer(num_layers(model), config.mix_init, config.mix_scale, mixed_layers=config.mixed_layers)
        # Under PEFT's `low_cpu_mem_usage` the scalars are made on the meta device, like the inner weights: loading
        # assigns the checkpoint's tensors (placed by `checkpoint_keys.loaded_adapter_state`).
        if not any(parameter.is_meta for parameter in mixer.parameters()):
            mixer = mixer.to(next(p.device for p in model.parameters()))
        self.bitune_mixers[adapter_name] = mixer
        self._route_to_active()
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

    @property
    def _position_limit(self) -> int | None:
        """How many positions a sequence may take on this model (`max_positions`); read once per model, kept out of the
        module tree."""
        return self._read_once("_position_limit_of", max_positions)

    @property
    def _sliding_window(self) -> bool:
        """Whether the model has a sliding-window layer (`has_sliding_window_layers`); read once per model."""
        return self._read_once("_sliding_window_of", lambda model: has_sliding_window_layers(model.config))

    def _read_once(self, key: str, read: Callable[[nn.Module], Any]) -> Any:
        """`read(self.model)`, kept (out of the module tree) for as long as the tuner wraps the same model."""
        cached = self.__dict__.get(key)
        if cached is None or cached[0] is not self.model:
            cached = self.__dict__[key] = (self.model, read(self.model))
        return cached[1]

    @contextmanager
    def weights(self, weight_set: WeightSet, decoder_layer: nn.Module | None = None) -> Iterator[None]:
        """Run the model (or only `decoder_layer`, one of its decoder layers) with one weight set of the active
        adapter; restores the previous routing on exit."""
        if weight_set not in WEIGHT_SETS:
            raise ValueError(f"`weight_set` must be one of {WEIGHT_SETS}, got {weight_set!r}.")
        self._check_has_active_adapter()
        with self._router.routed_to(self._inner_names(self.active_adapter)[weight_set], within=decoder_layer):
            yield

    # ------------------------------------------------------------------ state
    @property
    def mixer(self) -> BituneKVMixer:
        """The mixing scalars of the active adapter."""
        self._check_has_active_adapter()
        return self.bitune_mixers[self.active_adapter]

    def get_mixing_coefficients(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The alphas of an adapter (the active one by default): `{"keys": (num_layers,), "values": (num_layers,)}`,
        detached, float32."""
        if adapter_name is None:
            self._check_has_active_adapter()
            adapter_name = self.active_adapter
        self._check_adapter_exists(adapter_name)
        key_alpha, value_alpha = self.bitune_mixers[adapter_name].coefficients()
        return {"keys": key_alpha.detach(), "values": value_alpha.detach()}

    def _check_has_active_adapter(self) -> None:
        if not self._has_active_adapter():
            raise ValueError(
                "This Bitune model has no active adapter (the last one was deleted): only `forward` and `generate` "
                "run, as the base model. Add one with `add_adapter(name, BituneConfig(...))` or "
                "`load_adapter(path, adapter_name=name)`, then `set_adapter(name)`."
            )

    def _check_adapter_exists(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter `{adapter_name}` not found; available: {sorted(self.peft_config)}.")

    def _adapters_disabled(self) -> bool:
        """Whether the model runs as the base model: adapters disabled, or none left (all deleted)."""
        if not self._has_active_adapter():
            return True
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
        self._route_to_active()
        self._apply_trainable_state()

    def _has_active_adapter(self) -> bool:
        """False once the last adapter was deleted (PEFT's `active_adapters == []`)."""
        return isinstance(self.active_adapter, str) and self.active_adapter in self.peft_config

    def _route_to_active(self) -> None:
        """Route the layers to the causal weight set of the active adapter, or to none when there is none."""
        if self._has_active_adapter():
            self._router.route_to(self._inner_names(self.active_adapter)[CAUSAL])
        else:
            compat.route_layers(self._router.index.tuner_layers, [])

    def delete_adapter(self, adapter_name: str) -> None:
        """
        Delete a Bitune adapter: both its weight sets and its mixing scalars. As with PEFT's own methods, the last
        adapter can be deleted too: `active_adapters` is then `[]` and the model runs as the base model in `forward`
        and `generate` (what PEFT's layers do with no active adapter); `prefill`, which exists only to read a prompt
        twice, is refused until an adapter is added and made active with `set_adapter`.
        """
        if adapter_name not in self.peft_config:
            raise ValueError(f"Adapter `{adapter_name}` does not exist; available: {sorted(self.peft_config)}.")
        was_active = adapter_name == self.active_adapter
        remaining = [name for name in self.peft_config if name != adapter_name]
        if was_active:
            # Routed elsewhere first, so that the inner method never deletes a routed weight set and picks a weight
            # set of its own choosing (its warning would name an inner adapter, e.g. "other__bidirectional").
            self.active_adapter = remaining[0] if remaining else []
            self._route_to_active()
        for name in set(self._inner_names(adapter_name).values()):
            self._inner_tuner.delete_adapter(name)
        self._router.forget()
        del self.bitune_mixers[adapter_name]
        del self.peft_config[adapter_name]
        if was_active and remaining:
            # PEFT's own words, with the Bitune adapters' names.
            warnings.warn(
                f"Adapter {adapter_name} was active which is now deleted. Setting active adapter to {remaining[0]}.",
                stacklevel=2,
            )
        self._route_to_active()
        self._apply_trainable_state()

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
        self._route_to_active()
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

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """False: no LoRA of the base model computes what a Bitune adapter does, whatever its rank. The prompt is read
        twice (two weight sets, one bidirectionally) and the two caches mixed, so PEFT's `convert_to_lora`, which
        approximates one additive weight delta per layer, has no function to approximate."""
        return False

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
        paths = self._router.index.decoder_layer_paths
        # Recomputing the prompt's keys/values pays only where checkpointing keeps nothing else of a prompt pass, and
        # needs each cache layer's decoder layer (`layer_inputs.py`).
        recompute = bool(self._router.checkpointing_layers()) and len(paths) == num_layers(self.model)
        return BitunePasses(
            model=self.model,
            weights=self.weights,
            mixer=self.mixer,
            second_pass_attention=self.peft_config[self.active_adapter].second_pass_attention,
            stop_early=self._router.prompt_passes_may_stop_early(),
            recompute_prompt=recompute,
            decoder_layer_paths=paths,
        )

    # ------------------------------------------------------------------ mixed-adapter batches
    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """PEFT's hook around `PeftModel.forward` and `generate`, which drop `adapter_names` before calling the tuner:
        the call inside reads them from this context (`adapter_batches.call_names`)."""
        with adapter_batches.names_of_call(self, kwargs.get("adapter_names")):
            yield

    # ------------------------------------------------------------------ training forward
    @one_call_at_a_time
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        fused_lm_head: bool = False,
        shift_labels: torch.Tensor | None = None,
        adapter_names: list[str] | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | Any:
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
                causally with the causal weights, exactly like a decoding step of `generate` (without `position_ids`,
                positions counted over `attention_mask` as `generate` counts them, which left-padded rows need).
                `past_key_values`, its name before transformers 5.24, is accepted too.
            num_items_in_batch (`int`, *optional*): the number of supervised tokens the loss is averaged over (passed
                by `Trainer` under gradient accumulation); defaults to this batch's count.
            fused_lm_head (`bool`, *optional*): TRL's fused-head call (`fused_head.py`): return per-token
                log-probabilities of the labels instead of logits, scoring the answer positions only, in tiles. Rows
                whose labels mark no answer token then score nothing, as with TRL's own head.
            shift_labels (`torch.Tensor`, *optional*): refused (labels pre-shifted for context parallelism).
            adapter_names (`list[str]`, *optional*): one adapter name per row, as PEFT takes it (also through
                `PeftModel.forward`): each row runs with its own adapter, in one batch (`adapter_batches.py`); a
                `"__base__"` row is read once, causally, by the base model (logits at every position). Evaluation
                mode only.
            kwargs: other arguments of the model's forward. The three passes cover different parts of each row, so
                none is handed on: `position_ids` are accepted when they are the ordinary positions every pass uses
                anyway (0, 1, ... over each row's real tokens), or when they restart at 0 for each example of a
                packed row (TRL's `packing`/`padding_free`; `cu_seq_lens_*`, `max_length_*` and `seq_idx` are read
                as the same boundaries): each example is then read on its own, and no pass computes padding
                (`packing.py`). `logits_to_keep` is accepted when 0; anything else (e.g. `cache_position`,
                `token_type_ids`) is refused by name before any compute.

        Returns:
            `CausalLMOutputWithPast` whose `logits` (batch_size, seq_len, vocab) are aligned with the input. Positions
            before the last instruction token hold zeros: their logits are never used, and the LM head over a long
            prompt with a large vocabulary is not free. With `fused_lm_head=True`, TRL's `FusedCausalLMOutput`, its
            per-token fields (batch_size, seq_len - 1).
        """
        kwargs[compat.NEW_CACHE_NAME] = cache
        cache = compat.pop_cache(kwargs)  # `cache`, or its old name `past_key_values`
        sequence = input_ids if input_ids is not None else inputs_embeds
        rows = adapter_batches.row_adapters(self, adapter_names, None if sequence is None else sequence.shape[0],
                                            fused_lm_head=fused_lm_head)
        disabled = self._adapters_disabled()
        if fused_lm_head:
            check_fused_call(labels, shift_labels, cache)
            ensure_fused_head(self.model)
            if disabled:  # the base model alone: its own fused head
                warn_reference_without_adapter(self)
                return self.model(
                    input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, labels=labels,
                    num_items_in_batch=num_items_in_batch, fused_lm_head=True, **kwargs,
                )
        elif shift_labels is not None:
            kwargs["shift_labels"] = shift_labels  # refused by name below, as any argument the passes cannot take
        if cache is not None and not disabled:
            check_continuation_arguments(labels, prompt_mask)
            adapter_batches.refuse_base_rows_over_bitune_cache(rows, isinstance(cache, BituneCache))
        if disabled:
            generation.refuse_bitune_cache_while_disabled(cache)
        if cache is not None and not disabled and sequence is not None and "position_ids" not in kwargs:
            kwargs["position_ids"] = generation.continuation_positions(cache, attention_mask, sequence.shape[1])
        if disabled or cache is not None:
            # The base model alone, or a causal continuation of the cache with the causal weights (routed between
            # passes; each row's own in a mixed-adapter batch).
            with nullcontext() if rows is None else rows.routed(CAUSAL):
                return self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                  labels=labels, **compat.with_cache(self.model, cache), **kwargs)
        inputs = check_training_inputs(
            input_ids, inputs_embeds, attention_mask, labels, prompt_mask, kwargs, self._position_limit
        )
        if fused_lm_head:
            check_rows_to_read(inputs)
        if inputs.packed is not None:
            check_packing_supported(self.model)
            adapter_batches.refuse_packed_rows(rows)
        mode, parts = adapter_batches.multi_turn_of(rows, self.peft_config[self.active_adapter].multi_turn)
        if parts is not None:  # adapters that lay a conversation out differently: one forward each
            given = dict(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         labels=labels, prompt_mask=prompt_mask, **kwargs)
            return adapter_batches.forward_per_setting(self.forward, parts, rows, inputs, given, num_items_in_batch)
        inputs = adapter_batches.base_rows_read_once(inputs, rows)
        sequence = inputs.sequence
        read_layout = ConversationLayout.from_inputs if inputs.packed is None else ConversationLayout.from_packed
        layout = read_layout(inputs, mode=mode, read_rows_without_answer=fused_lm_head)
        check_sharding(self._router.index.decoder_layer_paths, num_layers(self.model), self.mixer)
        with self._router.checkpointing_keeps_caches():
            answer_outputs = self._passes().for_rows(rows).run_layout(layout, sequence, fused_head=fused_lm_head)
        if fused_lm_head:
            return fused_output(layout, answer_outputs, sequence.shape[:2], num_items_in_batch)
        answer_logits = [output.logits for output in answer_outputs]
        loss = None
        if labels is not None:
            loss = answer_loss(answer_logits, [turn.answer.labels for turn in layout.turns], num_items_in_batch)
        logits = layout.scatter_answers(answer_logits, sequence.shape[0], sequence.shape[1])
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # ------------------------------------------------------------------ generation
    # transformers' continuous batching, which PEFT would otherwise reach on the base model.
    generate_batch = init_continuous_batching = continuous_batching_context_manager = staticmethod(
        generation.refuse_continuous_batching)

    @torch.no_grad()
    @one_call_at_a_time
    def prefill(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: BituneCache | None = None,
        adapter_names: list[str] | None = None,
    ) -> BituneCache:
        """
        Read left-padded prompts twice and return the mixed cache of every prompt minus its last token.

        The result is a `BituneCache` (a transformers `DynamicCache`) holding `input_ids.shape[1] - 1` positions; pass
        it to `generate` with the full `input_ids`, or continue with forward calls (causal weights).

        With `cache` (of an earlier `generate` or `prefill` of this model), `input_ids` is the conversation the cache
        stands for (`cache.conversation_ids`) followed by a new instruction, as for `generate`: what the cache has not
        read of the conversation runs causally, then the new instruction minus its last token is read twice and mixed.
        The cache is extended in place and returned, ready for `generate` with the same `input_ids`. Laying out a
        conversation turn by turn without decoding (e.g. a server re-reading a chat history) is a chain of these,
        each with `cache.record_conversation` first naming the answer the next instruction follows.

        Args:
            input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): the prompts, left-padded.
            attention_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on real tokens.
            cache (`BituneCache`, *optional*): the conversation to continue.
            adapter_names (`list[str]`, *optional*): one adapter name per row: each row is read by its own adapter,
                in one batch (`adapter_batches.py`). Evaluation mode only.
        """
        check_token_ids(input_ids)
        if self._adapters_disabled():
            self._check_has_active_adapter()  # none left is said as such
            generation.refuse_prefill_while_disabled()
        rows = adapter_batches.row_adapters(self, adapter_names, input_ids.shape[0])
        prompts = self._checked_prompts(input_ids, attention_mask, cache, rows=rows)
        with generation.checkpointing_off(self._router.index.checkpoint_layers):
            if cache is None:
                return generation.prefill_cache(self._passes().for_rows(rows), prompts)
            generation.continue_conversation(self._passes().for_rows(rows), cache, prompts)
            cache.remember_conversation(prompts.input_ids[:, :-1], prompts.attention_mask[:, :-1])
            return cache

    @one_call_at_a_time
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """
        Bitune generation. Every argument of transformers' `generate` works as there.

        Without `cache`, the whole non-padding input is the instruction: prompts must be left-padded.
        With `cache` (the cache of an earlier Bitune `generate`, `output.cache` with `return_dict_in_generate=True`),
        `input_ids` is the conversation so far (the earlier output sequences) followed by the new instruction,
        left-padded within the new part; only the new part is read. Before transformers 5.24 both were called
        `past_key_values`; that name is accepted too.

        With `inputs_embeds` (the embeddings of every `input_ids` position, as transformers takes them), every pass
        reads the embeddings, and `input_ids` only names the tokens (in the output, and to check a continued chat).

        With beam search, the returned cache holds exactly the returned sequences, row for row, so that a conversation
        can go on from any of them. Assisted generation (`assistant_model`, `prompt_lookup_num_tokens`, ...) is
        refused, and so is a prompt plus `max_new_tokens` longer than the model's positions (see `max_positions`).

        With `output_attentions=True`, the attentions of the first step cover only the last prompt token (query length
        1, over the mixed cache), not the whole prompt as with the base model: the rest of the prompt was read by the
        two prompt passes. `peft_bitune.visualize.attention_maps` returns the attention of those passes.

        With `adapter_names` (one adapter name per prompt, or per returned sequence, as PEFT takes it, also through
        `PeftModel.generate`), each prompt is answered by its own adapter, in one batch (`adapter_batches.py`).
        """
        adapter_names = kwargs.pop("adapter_names", None)
        if self._adapters_disabled():
            cache = compat.pop_cache(kwargs)  # `adapter_names` dropped: every row runs the base model, as in PEFT
            generation.refuse_bitune_cache_while_disabled(cache)
            if cache is not None:
                kwargs[compat.CACHE_NAME] = cache
            return self.model.generate(*args, **kwargs)
        if args:
            if "input_ids" in kwargs or len(args) > 1:
                raise TypeError("Pass the prompt once, as `input_ids`; other `generate` arguments by keyword.")
            kwargs["input_ids"] = args[0]
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError(
                "Bitune `generate` needs `input_ids`, also with `inputs_embeds` (then the ids of the same positions): "
                "the output names the prompt by them, and a conversation is continued and checked by them."
            )
        cache = compat.pop_cache(kwargs)
        check_token_ids(input_ids)
        # transformers' own resolution and checks of the generation arguments, before the prompt passes run.
        generation_config = generation.checked_generation_config(self.model, kwargs)
        rows = adapter_batches.row_adapters(self, adapter_names, input_ids.shape[0],
                                            generation_config.num_return_sequences or 1)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = compat.inferred_attention_mask(self.model, input_ids, generation_config)
        prompts = self._checked_prompts(input_ids, attention_mask, cache, kwargs.get("inputs_embeds"), rows)
        check_generation_fits(self._position_limit, generation_config,
                              generation.max_length_is_set(self.model, kwargs), prompts.attention_mask)
        if rows is not None and rows.all_base:
            with rows.routed(CAUSAL):  # no prompt to read twice: the base model's own `generate`
                return self.model.generate(**kwargs)
        with generation.checkpointing_off(self._router.index.checkpoint_layers):
            return generation.decode(self._passes().for_rows(rows), prompts, cache, generation_config, kwargs)

    def _checked_prompts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any,
        inputs_embeds: torch.Tensor | None = None,
        rows: RowAdapters | None = None,
    ) -> Prompts:
        """The prompts of `prefill` or `generate`, checked where they enter: fresh ones by `check_prompts`, a
        conversation going on by its cache (`BituneCache.checked_continuation`) and by the way each adapter that
        continues it reads turns."""
        if cache is None:
            return check_prompts(input_ids, attention_mask, self._position_limit, inputs_embeds,
                                 sliding_window=self._sliding_window)
        if not isinstance(cache, BituneCache):
            raise ValueError(
                f"`cache` must be the cache of an earlier Bitune `generate` or `prefill` of this model "
                f"(a BituneCache), got {type(cache).__name__}. Bitune needs to know where the previous answer ends."
            )
        adapter_batches.refuse_base_rows_over_bitune_cache(rows, True)
        prompts = cache.checked_continuation(self.model, input_ids, attention_mask, self._position_limit,
                                             inputs_embeds)
        for name in [self.active_adapter] if rows is None else sorted(set(rows.names)):
            generation.check_history_continuation(self.peft_config[name].multi_turn, cache, prompts)
        return prompts

    # ------------------------------------------------------------------ checkpoint keys (PEFT's hooks)
    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: Any,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        """The entries of `adapter_name` a checkpoint holds (`checkpoint_keys.saved_adapter_state`)."""
        return saved_adapter_state(cls, model, config, adapter_name, state_dict)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        """A model key as a checkpoint names it, without the adapter name (`checkpoint_keys.checkpoint_key`)."""
        return checkpoint_key(key, adapter_name)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: Any, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A checkpoint's keys as the model names them, after checking it holds exactly this adapter's weights
        (`checkpoint_keys.loaded_adapter_state`)."""
        return loaded_adapter_state(cls, model, config, adapter_name, state_dict)

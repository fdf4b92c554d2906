"""Bitune generation: prefill the prompt twice, mix the caches, then let transformers' own `generate` decode.

Also continues a conversation from the cache of an earlier turn (paper A.8, alternating): the previous answer's last
token runs causally, the new instruction minus its last token is read twice over the whole cache and mixed, and
`generate` decodes from there. Mixed into `BituneModel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from . import compat
from .caches import BituneCache, append_key_values, pass_cache, reading_pass_cache
from .common import CAUSAL, WeightSet, has_holes, max_positions, text_config
from .inputs import attention_mask_for, check_not_empty, check_prompts, positions_for
from .passes import BitunePasses
from .routing import LayerRouter


class GenerationHost(Protocol):
    """What `BituneGenerationMixin` uses of the tuner it is mixed into (`BituneModel`), and all that it may use (a test
    reads the mixin's source and checks it)."""

    model: PreTrainedModel
    _router: LayerRouter

    def weights(self, weight_set: WeightSet) -> AbstractContextManager[None]: ...

    def _passes(self) -> BitunePasses: ...

    def _adapters_disabled(self) -> bool: ...


class BituneGenerationMixin:
    """`prefill` and `generate` of `BituneModel`; what they use of it is declared by `GenerationHost`."""

    @torch.no_grad()
    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> BituneCache:
        """
        Read left-padded prompts twice and return the mixed cache of every prompt minus its last token.

        The result is a `BituneCache` (a transformers `DynamicCache`) holding `input_ids.shape[1] - 1` positions; pass
        it to `generate` with the full `input_ids`, or continue with forward calls (causal weights).

        Args:
            input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): the prompts, left-padded.
            attention_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on real tokens.
        """
        attention_mask = check_prompts(input_ids, attention_mask, max_positions(self.model))
        with _checkpointing_off(self._router.index.checkpoint_layers):
            return self._prefill_cache(input_ids, attention_mask)

    def _prefill_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> BituneCache:
        prompt_ids, prompt_mask = input_ids[:, :-1], attention_mask[:, :-1]
        cache = BituneCache(config=self.model.config, owner=self.model)
        cache.record_conversation(prompt_ids, prompt_mask)
        if prompt_ids.shape[1] == 0:
            return cache
        passes = self._passes()
        mixed = passes.read_twice(
            lambda: pass_cache(len(cache.layers), record=True, stop_after_last_record=passes.stop_early),
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions_for(prompt_mask),
        )
        append_key_values(cache, *mixed)
        return cache

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """
        Bitune generation. Every argument of transformers' `generate` works as there.

        Without `cache`, the whole non-padding input is the instruction: prompts must be left-padded.
        With `cache` (the cache of an earlier Bitune `generate`, `output.cache` with `return_dict_in_generate=True`),
        `input_ids` is the conversation so far (the earlier output sequences) followed by the new instruction,
        left-padded within the new part; only the new part is read. Before transformers 5.24 both were called
        `past_key_values`; that name is accepted too.

        With `output_attentions=True`, the attentions of the first step cover only the last prompt token (query length
        1, over the mixed cache), not the whole prompt as with the base model: the rest of the prompt was read by the
        two prompt passes. `peft_bitune.visualize.attention_maps` returns the attention of those passes.
        """
        if self._adapters_disabled():
            cache = compat.pop_cache(kwargs)
            if cache is not None:
                kwargs[compat.CACHE_NAME] = cache
            return self.model.generate(*args, **kwargs)
        if args:
            if "input_ids" in kwargs or len(args) > 1:
                raise TypeError("Pass the prompt once, as `input_ids`; other `generate` arguments by keyword.")
            kwargs["input_ids"] = args[0]
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("Bitune `generate` needs `input_ids`: the prompt is read twice by token.")
        check_not_empty(input_ids)
        with _checkpointing_off(self._router.index.checkpoint_layers):
            return self._generate(input_ids, kwargs)

    def _generate(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        cache = compat.pop_cache(kwargs)
        # transformers' own resolution and checks of the generation arguments, before the prompt passes run.
        generation_config = _generation_config(self.model, kwargs)
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = compat.inferred_attention_mask(self.model, input_ids, generation_config)
        if cache is None:
            attention_mask = check_prompts(input_ids, attention_mask, max_positions(self.model))
            with torch.no_grad():
                cache = self._prefill_cache(input_ids, attention_mask)
            if expand > 1:
                cache.batch_repeat_interleave(expand)
        else:
            attention_mask = self._check_conversation(cache, input_ids, attention_mask, expand)
            with torch.no_grad():
                self._continue_conversation(cache, input_ids, attention_mask)
        kwargs["attention_mask"] = attention_mask
        output = self.model.generate(**{compat.CACHE_NAME: cache}, **kwargs)
        sequences = output.sequences if hasattr(output, "sequences") else output
        rows_per_prompt = sequences.shape[0] // attention_mask.shape[0]
        generated = sequences.shape[1] - attention_mask.shape[1]
        cache.record_conversation(sequences, torch.cat([
            attention_mask.repeat_interleave(rows_per_prompt, dim=0),
            attention_mask.new_ones(sequences.shape[0], generated),  # what `generate` fed for every new token
        ], dim=1))
        return output

    def _check_conversation(
        self, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, expand: int
    ) -> torch.Tensor:
        """Refuse, before any compute, a cache or input that cannot continue this conversation."""
        if not isinstance(cache, BituneCache):
            raise ValueError(
                f"`cache` must be the cache of an earlier Bitune `generate` or `prefill` of this model "
                f"(a BituneCache), got {type(cache).__name__}. Bitune needs to know where the previous answer ends."
            )
        config = text_config(self.model)
        if not cache.belongs_to(self.model):
            raise ValueError(
                "`cache` was made by another model: continue a conversation with the model that started it."
            )
        if len(cache.layers) != config.num_hidden_layers:
            raise ValueError(
                f"`cache` has {len(cache.layers)} layers but this model has {config.num_hidden_layers}: "
                "it belongs to another model."
            )
        layer = cache.layers[0]
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if layer.keys is not None and tuple(layer.keys.shape[1:2]) + tuple(layer.keys.shape[3:]) != (heads, head_dim):
            raise ValueError(
                f"`cache` holds keys of shape {tuple(layer.keys.shape)}, which does not fit this model "
                f"({heads} key/value heads of size {head_dim}): it belongs to another model."
            )
        if layer.keys is not None and layer.keys.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"`cache` holds {layer.keys.shape[0]} sequences but `input_ids` has {input_ids.shape[0]} "
                "rows; continue each conversation with exactly one row."
            )
        if expand > 1:
            raise NotImplementedError(
                "Continuing a conversation supports one sequence per row (`num_beams=1`, `num_return_sequences=1`)."
            )
        attention_mask = attention_mask_for(input_ids, attention_mask)
        cache.check_continuation(input_ids, attention_mask)
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError("The new instruction must be left-padded: every row must end with a real token.")
        if any(cache.is_sliding) and bool(has_holes(attention_mask).any()):
            raise ValueError(
                "This model has sliding-window layers, whose window is counted in cache columns, and the conversation "
                "has padding between real tokens (rows whose turns have different lengths). Continue such "
                "conversations one row at a time, or pad the new instructions to equal lengths."
            )
        positions = max_positions(self.model)
        if positions is not None and int(attention_mask.sum(dim=1).max()) > positions:
            raise ValueError(
                f"The conversation is longer than the model's {positions} positions (nothing is truncated "
                "silently); start a new conversation or shorten it."
            )
        return attention_mask

    def _continue_conversation(
        self, cache: BituneCache, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> None:
        """Bring `cache` to the new instruction's last token: the previous answer's tail causally, then the new
        instruction minus its last token read twice over the whole cache, mixed and appended."""
        positions = positions_for(attention_mask)
        past, answered, width = cache.get_seq_length(), cache.conversation_length, input_ids.shape[1]
        if answered > past:
            with self.weights(CAUSAL):
                self.model(
                    input_ids=input_ids[:, past:answered],
                    attention_mask=attention_mask[:, :answered],
                    position_ids=positions[:, past:answered],
                    **compat.with_cache(self.model, cache),
                    use_cache=True,
                )
        if width - 1 == answered:
            return  # a one-token instruction adds nothing to mix
        passes = self._passes()
        mixed = passes.read_twice(
            lambda: reading_pass_cache(cache, passes.stop_early),
            input_ids=input_ids[:, answered : width - 1],
            attention_mask=attention_mask[:, : width - 1],
            position_ids=positions[:, answered : width - 1],
        )
        append_key_values(cache, *mixed)


@contextmanager
def _checkpointing_off(checkpoint_layers: Iterable[GradientCheckpointingLayer]) -> Iterator[None]:
    """Generation needs its caches, which checkpointed layers drop in training mode; without gradients,
    checkpointing saves nothing anyway. Restored on exit."""
    layers = [layer for layer in checkpoint_layers if layer.gradient_checkpointing]
    try:
        for layer in layers:
            layer.gradient_checkpointing = False
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


def _generation_config(model: Any, kwargs: dict[str, Any]) -> Any:
    """
    The generation config `generate` will use, resolved and validated by transformers' own code (e.g. it refuses
    `max_new_tokens=0`), so that bad arguments fail before the prompt passes run. Refuses `use_cache=False`.
    """
    generation_config = compat.resolved_generation_config(model, kwargs)
    if generation_config.use_cache is False:
        raise ValueError(
            "`use_cache=False` is not supported by Bitune generation: the prompt is read twice and the two key/value "
            "caches are mixed, and every answer token must attend to that mixed cache. Without a cache, `generate` "
            "would re-read the whole sequence causally at every step and give other tokens. Remove `use_cache=False` "
            "(or set `generation_config.use_cache = True`); decoding then costs what it costs for the base model."
        )
    return generation_config

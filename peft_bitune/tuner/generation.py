"""Bitune generation: prefill the prompt twice, mix the caches, then let transformers' own `generate` decode.

Also continues a conversation from the cache of an earlier turn (paper A.8, alternating): the previous answer's last
token runs causally, the new instruction minus its last token is read twice over the whole cache and mixed, and
`generate` decodes from there. Mixed into `BituneModel`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer

from .. import compat
from ..constants import CAUSAL, WeightSet
from ..utils.model_config import max_positions, text_config
from .caches import BituneCache, append_key_values, pass_cache, reading_pass_cache
from .checks import attention_mask_for, check_not_empty, check_prompts, has_holes, positions_for
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
    def prefill(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, cache: BituneCache | None = None
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
        """
        with _checkpointing_off(self._router.index.checkpoint_layers):
            if cache is None:
                attention_mask = check_prompts(input_ids, attention_mask, max_positions(self.model))
                return self._prefill_cache(input_ids, attention_mask)
            check_not_empty(input_ids)
            attention_mask = self._check_conversation(cache, input_ids, attention_mask)
            self._continue_conversation(cache, input_ids, attention_mask)
            cache.record_conversation(input_ids[:, :-1], attention_mask[:, :-1])
            return cache

    def _prefill_cache(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> BituneCache:
        """The mixed cache of the prompts minus their last token; the passes read `inputs_embeds` where given (the
        embeddings of every `input_ids` position), the token ids otherwise."""
        prompt_ids, prompt_mask = input_ids[:, :-1], attention_mask[:, :-1]
        cache = BituneCache(config=self.model.config, owner=self.model)
        cache.record_conversation(prompt_ids, prompt_mask)
        if prompt_ids.shape[1] == 0:
            return cache
        passes = self._passes()
        mixed = passes.read_twice(
            lambda: pass_cache(len(cache.layers), record=True, stop_after_last_record=passes.stop_early),
            **_tokens(input_ids, inputs_embeds, 0, -1),
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

        With `inputs_embeds` (the embeddings of every `input_ids` position, as transformers takes them), every pass
        reads the embeddings, and `input_ids` only names the tokens (in the output, and to check a continued chat).

        With beam search, the returned cache holds exactly the returned sequences, row for row, so that a conversation
        can go on from any of them. Assisted generation (`assistant_model`, `prompt_lookup_num_tokens`, ...) is
        refused, and so is a prompt plus `max_new_tokens` longer than the model's positions (see `max_positions`).

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
            raise ValueError(
                "Bitune `generate` needs `input_ids`, also with `inputs_embeds` (then the ids of the same positions): "
                "the output names the prompt by them, and a conversation is continued and checked by them."
            )
        check_not_empty(input_ids)
        with _checkpointing_off(self._router.index.checkpoint_layers):
            return self._generate(input_ids, kwargs)

    def _generate(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        cache = compat.pop_cache(kwargs)
        continuing = cache is not None
        # transformers' own resolution and checks of the generation arguments, before the prompt passes run.
        generation_config = _generation_config(self.model, kwargs)
        expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        inputs_embeds = _checked_embeddings(kwargs.get("inputs_embeds"), input_ids)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = compat.inferred_attention_mask(self.model, input_ids, generation_config)
        if continuing:
            attention_mask = self._check_conversation(cache, input_ids, attention_mask)
        else:
            attention_mask = check_prompts(input_ids, attention_mask, max_positions(self.model))
        _check_generation_fits(self.model, generation_config, kwargs, attention_mask)
        with torch.no_grad():
            if continuing:
                self._continue_conversation(cache, input_ids, attention_mask, inputs_embeds)
            else:
                cache = self._prefill_cache(input_ids, attention_mask, inputs_embeds)
        # Beam search leaves the cache rows of its last running beams, not of the sequences it returns: keep the
        # cache as it is before decoding, to rebuild the returned sequences' rows where the caller can reach the cache.
        before_decoding = None
        if (generation_config.num_beams or 1) > 1 and (continuing or generation_config.return_dict_in_generate):
            before_decoding = copy.deepcopy(cache)
        if expand > 1:
            cache.batch_repeat_interleave(expand)
        kwargs["attention_mask"] = attention_mask
        output = self.model.generate(**{compat.CACHE_NAME: cache}, **kwargs)
        sequences = output.sequences if hasattr(output, "sequences") else output
        rows_per_prompt = sequences.shape[0] // attention_mask.shape[0]
        generated = sequences.shape[1] - attention_mask.shape[1]
        conversation_mask = torch.cat([
            attention_mask.repeat_interleave(rows_per_prompt, dim=0),
            attention_mask.new_ones(sequences.shape[0], generated),  # what `generate` fed for every new token
        ], dim=1)
        if before_decoding is not None:
            with torch.no_grad():
                self._hold_sequences(
                    cache, before_decoding, sequences, conversation_mask, inputs_embeds, input_ids.shape[1]
                )
        cache.record_conversation(sequences, conversation_mask)
        return output

    def _hold_sequences(
        self,
        cache: BituneCache,
        before_decoding: BituneCache,
        sequences: torch.Tensor,
        conversation_mask: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        input_width: int,
    ) -> None:
        """
        Make `cache` hold exactly `sequences`, row for row: the cache as it was before decoding (every column of the
        input but the last), one copy per returned sequence, extended causally by each sequence's last input token
        (its embedding, where the input came as embeddings) and generated tokens but the last (which was never fed,
        as in any decoding). This is what decoding each sequence alone would have left, so a conversation goes on from
        any of them as from a fresh read.
        """
        rows_per_input = sequences.shape[0] // before_decoding.conversation_ids.shape[0]
        before_decoding.batch_repeat_interleave(rows_per_input)
        start, end = input_width - 1, sequences.shape[1] - 1
        if inputs_embeds is not None:
            last_input = inputs_embeds[:, start:input_width].repeat_interleave(rows_per_input, dim=0)
            self._run_causally(before_decoding, {"inputs_embeds": last_input}, conversation_mask, start, input_width)
            start = input_width
        if end > start:
            self._run_causally(before_decoding, {"input_ids": sequences[:, start:end]}, conversation_mask, start, end)
        cache.layers[:] = before_decoding.layers

    def _run_causally(
        self, cache: BituneCache, inputs: dict[str, torch.Tensor], attention_mask: torch.Tensor, start: int, end: int
    ) -> None:
        """Append columns `start:end` of a conversation (`inputs`: their ids or embeddings) to `cache`, read with the
        causal weights as decoding reads them; `attention_mask` covers the whole conversation."""
        with self.weights(CAUSAL):
            self.model(
                **inputs,
                attention_mask=attention_mask[:, :end],
                position_ids=positions_for(attention_mask)[:, start:end],
                **compat.with_cache(self.model, cache),
                use_cache=True,
            )

    def _check_conversation(
        self, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
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
        self,
        cache: BituneCache,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> None:
        """Bring `cache` to the new instruction's last token: the previous answer's tail causally, then the new
        instruction minus its last token read twice over the whole cache, mixed and appended. The passes read
        `inputs_embeds` where given, the token ids otherwise."""
        past, answered, width = cache.get_seq_length(), cache.conversation_length, input_ids.shape[1]
        if answered > past:
            tail = _tokens(input_ids, inputs_embeds, past, answered)  # the previous answer's last token(s)
            self._run_causally(cache, tail, attention_mask, past, answered)
        if width - 1 == answered:
            return  # a one-token instruction adds nothing to mix
        passes = self._passes()
        mixed = passes.read_twice(
            lambda: reading_pass_cache(cache, passes.stop_early),
            **_tokens(input_ids, inputs_embeds, answered, width - 1),
            attention_mask=attention_mask[:, : width - 1],
            position_ids=positions_for(attention_mask)[:, answered : width - 1],
        )
        append_key_values(cache, *mixed)


def _tokens(
    input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None, start: int, end: int
) -> dict[str, torch.Tensor]:
    """Columns `start:end` of the input, as a pass reads them: the embeddings where given, else the token ids."""
    if inputs_embeds is not None:
        return {"inputs_embeds": inputs_embeds[:, start:end]}
    return {"input_ids": input_ids[:, start:end]}


def _checked_embeddings(inputs_embeds: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """`inputs_embeds` given with `input_ids` must embed every one of its positions (transformers' `generate` then
    reads the embeddings and only reports the ids), so that every pass can read them."""
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[:2] != input_ids.shape):
        raise ValueError(
            f"`inputs_embeds` has shape {tuple(inputs_embeds.shape)} but `input_ids` has {tuple(input_ids.shape)}: "
            "give the embedding of every `input_ids` position, (batch_size, seq_len, hidden_size), or only "
            "`input_ids`."
        )
    return inputs_embeds


def _check_generation_fits(
    model: Any, generation_config: Any, kwargs: dict[str, Any], attention_mask: torch.Tensor
) -> None:
    """
    Refuse, before the prefill, a generation that can run past the model's positions (`max_positions`): the longest
    row's real tokens plus the tokens it may generate. Without `max_new_tokens` or any `max_length` set, transformers
    generates at most 20 tokens and stops at the model's positions by itself; nothing to check then.
    """
    limit = max_positions(model)
    if limit is None:
        return
    width = attention_mask.shape[1]
    if generation_config.max_new_tokens is not None:
        new_tokens, setting = generation_config.max_new_tokens, f"max_new_tokens={generation_config.max_new_tokens}"
    elif _max_length_is_set(model, kwargs):
        new_tokens, setting = generation_config.max_length - width, f"max_length={generation_config.max_length}"
    else:
        return
    longest = int(attention_mask.sum(dim=1).max())
    if longest + new_tokens > limit:
        raise ValueError(
            f"The longest input has {longest} tokens and `{setting}` lets it grow to {longest + new_tokens}, past the "
            f"model's {limit} positions (`max_position_embeddings`); nothing would stop it there. Set "
            f"`max_new_tokens` to at most {limit - longest}, or shorten the input."
        )


def _max_length_is_set(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether `max_length` was set (as an argument, in the given generation config, or in the model's), so that
    transformers takes it as the total length rather than generating its default 20 tokens."""
    given = kwargs.get("generation_config")
    return any(
        value is not None
        for value in (kwargs.get("max_length"), getattr(given, "max_length", None), model.generation_config.max_length)
    )


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
    `max_new_tokens=0`), so that bad arguments fail before the prompt passes run. Refuses assisted generation and
    `use_cache=False`.
    """
    generation_config = compat.resolved_generation_config(model, kwargs)
    mode = generation_config.get_generation_mode(kwargs.get("assistant_model"))
    if mode == GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            "Assisted generation (`assistant_model`, `prompt_lookup_num_tokens`, `assistant_early_exit`) is not "
            "supported by Bitune generation: transformers' assisted decoding begins by re-reading the whole input "
            "causally on top of the cache it is given, and the cache Bitune gives it already holds the mixed prompt, "
            "so the answer would differ from plain decoding. Remove the assistant arguments; decoding a token costs "
            "what it costs for the base model with one adapter."
        )
    if generation_config.use_cache is False:
        raise ValueError(
            "`use_cache=False` is not supported by Bitune generation: the prompt is read twice and the two key/value "
            "caches are mixed, and every answer token must attend to that mixed cache. Without a cache, `generate` "
            "would re-read the whole sequence causally at every step and give other tokens. Remove `use_cache=False` "
            "(or set `generation_config.use_cache = True`); decoding then costs what it costs for the base model."
        )
    return generation_config

"""
Bitune generation: the prompt read twice and mixed, then transformers' own `generate` decodes.

`BituneModel.prefill` and `BituneModel.generate` check their inputs (`checks.check_prompts`, or the cache's
`checked_continuation` for a conversation going on) and hand the checked `Prompts` to the functions here, which run
the passes of `passes.py` and never check the prompts again:

- `prefill_cache`: a fresh cache, the mix of the two prompt passes over every prompt minus its last token;
- `continue_conversation` (paper A.8, alternating): the previous answer's last token runs causally, then the new
  instruction minus its last token is read twice over the whole cache and mixed;
- `decode`: either of those, then `generate` decodes from the cache; after beam search the cache is made to hold the
  returned sequences, so that a conversation can go on from any of them.

Every pass and the decoding run through `BitunePasses.routed`: the active adapter's weight set, or each row's own for
a batch whose rows name different adapters (`adapter_batches.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.generation import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer

from .. import compat
from ..constants import CAUSAL
from .caches import BituneCache, pass_cache, reading_pass_cache
from .checks import Prompts, positions_for
from .passes import BitunePasses


def prefill_cache(passes: BitunePasses, prompts: Prompts) -> BituneCache:
    """The mixed cache of the prompts minus their last token."""
    model = passes.model
    prompt_mask = prompts.attention_mask[:, :-1]
    cache = BituneCache(config=model.config, owner=model)
    cache.remember_conversation(prompts.input_ids[:, :-1], prompt_mask)
    if prompt_mask.shape[1] == 0:
        return cache
    mixed = passes.read_twice(
        lambda: pass_cache(len(cache.layers), record=True, stop_after_last_record=passes.stop_early),
        **prompts.tokens(0, -1),
        attention_mask=prompt_mask,
        position_ids=positions_for(prompt_mask),
    )
    cache.append_key_values(*mixed)
    return cache


def continue_conversation(passes: BitunePasses, cache: BituneCache, prompts: Prompts) -> None:
    """Bring `cache` to the new instruction's last token: the previous answer's tail causally, then the new
    instruction minus its last token read twice over the whole cache, mixed and appended."""
    past, answered, width = cache.get_seq_length(), cache.conversation_length, prompts.width
    if answered > past:
        with passes.routed(CAUSAL):
            run_causally(passes.model, cache, prompts.tokens(past, answered), prompts.attention_mask, past, answered)
    if width - 1 == answered:
        return  # a one-token instruction adds nothing to mix
    mixed = passes.read_twice(
        lambda: reading_pass_cache(cache, passes.stop_early),
        **prompts.tokens(answered, width - 1),
        attention_mask=prompts.attention_mask[:, : width - 1],
        position_ids=positions_for(prompts.attention_mask)[:, answered : width - 1],
    )
    cache.append_key_values(*mixed)


def run_causally(
    model: Any,
    cache: BituneCache,
    inputs: dict[str, torch.Tensor],
    attention_mask: torch.Tensor,
    start: int,
    end: int,
) -> None:
    """Append columns `start:end` of a conversation (`inputs`: their ids or embeddings) to `cache`, read causally as
    decoding reads them, with the weights the model is routed to (the causal weight set, or none); `attention_mask`
    covers the whole conversation."""
    model(
        **inputs,
        attention_mask=attention_mask[:, :end],
        position_ids=positions_for(attention_mask)[:, start:end],
        **compat.with_cache(model, cache),
        use_cache=True,
    )


def decode(
    passes: BitunePasses, prompts: Prompts, cache: BituneCache | None, generation_config: Any, kwargs: dict[str, Any]
) -> Any:
    """Read the prompts into `cache` (a new one without `cache`), let transformers' `generate` decode with `kwargs`
    (with the causal weights: each row's, in a mixed-adapter batch), and leave the cache holding the returned
    sequences."""
    continuing = cache is not None
    with torch.no_grad():
        if continuing:
            continue_conversation(passes, cache, prompts)
        else:
            cache = prefill_cache(passes, prompts)
    # Beam search leaves the cache rows of its last running beams, not of the sequences it returns: keep the cache as
    # it is before decoding, to rebuild the returned sequences' rows where the caller can reach the cache.
    before_decoding = None
    if (generation_config.num_beams or 1) > 1 and (continuing or generation_config.return_dict_in_generate):
        before_decoding = copy.deepcopy(cache)
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    if expand > 1:
        cache.batch_repeat_interleave(expand)
    attention_mask = prompts.attention_mask
    kwargs["attention_mask"] = attention_mask
    with passes.routed(CAUSAL):
        output = passes.model.generate(**{compat.CACHE_NAME: cache}, **kwargs)
    sequences = output.sequences if hasattr(output, "sequences") else output
    rows_per_prompt = sequences.shape[0] // attention_mask.shape[0]
    generated = sequences.shape[1] - attention_mask.shape[1]
    conversation_mask = torch.cat([
        attention_mask.repeat_interleave(rows_per_prompt, dim=0),
        attention_mask.new_ones(sequences.shape[0], generated),  # what `generate` fed for every new token
    ], dim=1)
    if before_decoding is not None:
        with torch.no_grad(), passes.routed(CAUSAL):
            _hold_sequences(passes.model, cache, before_decoding, sequences, conversation_mask, prompts)
    cache.remember_conversation(sequences, conversation_mask)
    return output


def _hold_sequences(
    model: Any,
    cache: BituneCache,
    before_decoding: BituneCache,
    sequences: torch.Tensor,
    conversation_mask: torch.Tensor,
    prompts: Prompts,
) -> None:
    """
    Make `cache` hold exactly `sequences`, row for row: the cache as it was before decoding (every column of the
    input but the last), one copy per returned sequence, extended causally by each sequence's last input token (its
    embedding, where the input came as embeddings) and generated tokens but the last (which was never fed, as in any
    decoding). This is what decoding each sequence alone would have left, so a conversation goes on from any of them
    as from a fresh read.
    """
    rows_per_input = sequences.shape[0] // before_decoding.conversation_ids.shape[0]
    before_decoding.batch_repeat_interleave(rows_per_input)
    input_width = prompts.width
    start, end = input_width - 1, sequences.shape[1] - 1
    if prompts.inputs_embeds is not None:
        last_input = prompts.inputs_embeds[:, start:input_width].repeat_interleave(rows_per_input, dim=0)
        run_causally(model, before_decoding, {"inputs_embeds": last_input}, conversation_mask, start, input_width)
        start = input_width
    if end > start:
        run_causally(model, before_decoding, {"input_ids": sequences[:, start:end]}, conversation_mask, start, end)
    cache.layers[:] = before_decoding.layers


def check_history_continuation(multi_turn: str, cache: BituneCache, prompts: Prompts) -> None:
    """A `multi_turn="history"` adapter reads everything before an answer as one instruction, twice: a cache cannot
    take it to a new turn, which `continue_conversation` would read the alternating way. A cache that already stands
    for all of the input but its last token (a fresh `prefill`, or a retry of the same prompt) reads nothing new."""
    if multi_turn == "history" and cache.conversation_length < prompts.width - 1:
        raise ValueError(
            "This adapter was trained with `multi_turn='history'`, which reads the whole conversation before each "
            "answer as one instruction, so a `cache` cannot continue it with new tokens: call `generate` (or "
            "`prefill`) without `cache`, on the whole conversation so far."
        )


def refuse_bitune_cache_while_disabled(cache: Any) -> None:
    """With the adapters disabled the model is the base model, which must not decode over Bitune's mixed cache (nor
    grow it past the conversation it records)."""
    if isinstance(cache, BituneCache):
        raise ValueError(
            "A Bitune cache holds the mixed keys/values of the Bitune adapter, so it cannot be used with the adapters "
            "disabled (`disable_adapter()`), which run the base model: call the base model without `cache` (or with "
            "a cache of its own), or continue the conversation outside `disable_adapter()`."
        )


def refuse_continuous_batching(*args: Any, **kwargs: Any) -> None:
    """transformers' continuous batching (`generate_batch`, `cache_implementation="paged"`) fills a paged cache of its
    own and splits prompts across steps, so it cannot read a prompt twice; reached through PEFT, which hands the
    attributes it lacks to the inner model, it would run the base model without a word."""
    raise ValueError(
        "transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `cache_implementation="
        "'paged'`) is not supported by Bitune: it builds its own paged cache and splits prompts across steps, so it "
        "would run the base model with no Bitune prefill. Use `generate` with a batch of left-padded prompts, or "
        "serve the adapter on vLLM (`vllm_integration.load_llm`, docs/serving.md)."
    )


def refuse_prefill_while_disabled() -> None:
    """`prefill` inside `disable_adapter()` would mix two base-model passes with the adapter's scalars: a cache that
    is neither the base model's nor the adapter's."""
    raise ValueError(
        "`prefill` reads the prompt with the adapter's two weight sets, which `disable_adapter()` turns off: call it "
        "outside `disable_adapter()`, or, for the base model's cache, run the base model's forward with "
        "`use_cache=True` inside it."
    )


def continuation_positions(cache: Any, attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """
    The position ids of `length` new tokens that a forward runs over `cache`, as `generate` computes them (real tokens
    counted from 0), so that a forward over a left-padded `prefill` is exactly a decoding step. `None` where the
    model's own default (the cache length onward) is already that: no padding anywhere.

    A Bitune cache of padded rows with no `attention_mask` is refused: the model would attend to the padding and
    count it as positions.
    """
    if attention_mask is not None:
        expected = cache.get_seq_length() + length
        if attention_mask.shape[-1] != expected:
            raise ValueError(
                f"`attention_mask` has {attention_mask.shape[-1]} columns, but a forward of {length} new tokens over "
                f"a cache of {cache.get_seq_length()} positions needs {expected}: the mask of what the cache holds, "
                "then the new tokens'."
            )
        return positions_for(attention_mask)[:, -length:]
    if isinstance(cache, BituneCache) and cache.conversation_mask is not None and not cache.conversation_mask.all():
        raise ValueError(
            "This cache holds left-padded rows, so a forward over it needs `attention_mask`: the mask of the "
            "conversation the cache holds (e.g. the prompts' mask given to `prefill`) followed by 1 for each new "
            "token, as `generate` passes it."
        )
    return None


def max_length_is_set(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether `max_length` was set (as an argument, in the given generation config, or in the model's), so that
    transformers takes it as the total length rather than generating its default 20 tokens."""
    given = kwargs.get("generation_config")
    return any(
        value is not None
        for value in (kwargs.get("max_length"), getattr(given, "max_length", None), model.generation_config.max_length)
    )


@contextmanager
def checkpointing_off(checkpoint_layers: Iterable[GradientCheckpointingLayer]) -> Iterator[None]:
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


def checked_generation_config(model: Any, kwargs: dict[str, Any]) -> Any:
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
    if kwargs.get("cache_implementation") == "paged" or generation_config.cache_implementation == "paged":
        refuse_continuous_batching()
    if generation_config.use_cache is False:
        raise ValueError(
            "`use_cache=False` is not supported by Bitune generation: the prompt is read twice and the two key/value "
            "caches are mixed, and every answer token must attend to that mixed cache. Without a cache, `generate` "
            "would re-read the whole sequence causally at every step and give other tokens. Remove `use_cache=False` "
            "(or set `generation_config.use_cache = True`); decoding then costs what it costs for the base model."
        )
    return generation_config

"""The passes of Bitune: what a forward computes once the tuner (`model.py`, PEFT's bookkeeping) has checked it.

For each instruction segment x_1..x_m of a training row:

1. the bidirectional prompt pass reads x_1..x_{m-1} with the bidirectional weights and a bidirectional mask,
2. the causal prompt pass reads the same tokens with the causal weights and the causal mask,
3. the two key/value caches are mixed per layer (`BituneKVMixer`),
4. the answer pass runs x_m and the answer causally, with the causal weights, over the mixed cache.

In a training step each decoder layer of the answer pass computes the mix where it reads it, from what the prompt
passes left: their keys/values, or under checkpointing their layer inputs, from which it recomputes the keys/values
and, in its backward, differentiates the prompt passes' layer at once (`layer_inputs.py`); the mix is never held
across layers. Only the turns a later turn of the same row reads (multi-turn rows) are recorded and mixed at once,
since every layer of every later pass reads them.
`generate` runs steps 1-3 on the prompt through `BitunePasses.read_twice`, recording. The tuner (`BituneModel`)
builds a `BitunePasses` for each forward: it hands over the model, how to route the layers to a weight set, the mixing
scalars of the active adapter (or, for a batch whose rows name different adapters, each row's weight sets and
coefficients: `adapter_batches.RowAdapters`) and the choices that depend on how the model is wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache

from .. import compat
from ..constants import BIDIRECTIONAL, CAUSAL, IGNORE_INDEX, SecondPassAttention, WeightSet
from ..utils.base_model import decoder_of, num_layers
from .adapter_batches import RowAdapters
from .caches import (
    TrainingCache,
    merge_recorded_rows,
    pass_cache,
    pass_cache_rows,
    recomputing_pass_cache,
    recorded_key_values,
)
from .checks import check_attention_reads_is_causal
from .layer_inputs import ChainedRead, HeldKeyValues, PromptMix, PromptPassChain, capturing_layer_calls
from .layout import Chunk, ConversationLayout, Turn
from .mixing import BituneKVMixer, at_least_float32
from .packing import Places, masks_for_pass
from .prompt_pass_end import ending_at_complete_record
from .sharding import LayerPath, unshard_before_backward

KeyValues = tuple[list[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class BitunePasses:
    """
    The passes of one forward of the active Bitune adapter.

    Args:
        model (`nn.Module`): the causal LM, with the inner PEFT method's layers.
        weights (`Callable`): `weights(weight_set)` is a context manager that runs the model with that weight set;
            `weights(weight_set, decoder_layer)` routes that decoder layer alone.
        mixer (`BituneKVMixer`): the active adapter's mixing scalars.
        second_pass_attention (`str`): the mask of the bidirectional prompt pass (`"causal"` is the paper's ablation).
        stop_early (`bool`): whether a prompt pass may end once the last layer has recorded its keys/values (see
            `prompt_pass_end.may_end_early`).
        recompute_prompt (`bool`): whether a training step's prompt passes run their decoder layers without
            autograd and leave their layer inputs, read layer by layer by the answer pass (`layer_inputs.py`), rather
            than their keys/values; under checkpointing, where each cache layer has its decoder layer in
            `decoder_layer_paths`.
        decoder_layer_paths (`Sequence[LayerPath]`): where each decoder layer sits, to find FSDP2 units.
        rows (`RowAdapters`, *optional*): for a batch whose rows name different adapters, each row's weight set of
            each pass, mask of the second pass and coefficients, used instead of `weights`, `second_pass_attention`
            and `mixer`.
    """

    model: nn.Module
    weights: Callable[..., AbstractContextManager]
    mixer: BituneKVMixer
    second_pass_attention: SecondPassAttention
    stop_early: bool
    recompute_prompt: bool
    decoder_layer_paths: Sequence[LayerPath]
    rows: RowAdapters | None = None

    def for_rows(self, rows: RowAdapters | None) -> BitunePasses:
        """These passes with each row's own adapter (`rows`), or as they are (`None`)."""
        return self if rows is None else replace(self, rows=rows)

    def routed(self, weight_set: WeightSet) -> AbstractContextManager:
        """Run the model with weight set `weight_set`: the active adapter's, or each row's own."""
        return self.weights(weight_set) if self.rows is None else self.rows.routed(weight_set)

    def run_layout(self, layout: ConversationLayout, sequence: torch.Tensor, fused_head: bool = False) -> list[Any]:
        """All turns of a training batch; returns each turn's answer-pass output, in layout order. `sequence` is the
        input ids (batch, seq) or embeddings (batch, seq, hidden). See `answer_pass` for `fused_head`."""
        outputs = []
        for turns, rows in layout.runs(sequence):
            selected = turns[0].rows  # a history-mode turn runs on the rows that have it
            passes = self if self.rows is None or selected is None else replace(self, rows=self.rows.select(selected))
            outputs += passes.run_turns(turns, rows, fused_head)
        return outputs

    def run_turns(self, turns: list[Turn], sequence: torch.Tensor, fused_head: bool = False) -> list[Any]:
        """
        Run instruction/answer turns in order over one growing cache; returns each turn's answer-pass output.

        Per turn: both prompt passes over x_1..x_{m-1} on top of the cache so far, their mix appended to the cache;
        then x_m and the answer causally, their causal keys/values appended for the next turn. A turn that nothing
        comes before or after (every single-turn row) has its mix computed by the answer pass where it reads it
        (`answer_over_prompt`).
        """
        if len(turns) == 1:
            return [self.answer_over_prompt(turns[0], sequence, fused_head)]
        cache: TrainingCache | None = None
        outputs = []
        for number, turn in enumerate(turns):
            is_last = number == len(turns) - 1
            if turn.prefill.width > 0:
                keys, values = self.read_twice(
                    lambda: self._recording_cache(cache),
                    **turn.prefill.pass_inputs(sequence, None if cache is None else cache.mask),
                )
                cache = TrainingCache.extend(cache, keys, values, turn.prefill.as_past)
            answer_cache = _pass_cache(cache, self.model, record=not is_last)
            past = None if cache is None else cache.mask
            outputs.append(self.answer_pass(turn.answer, sequence, answer_cache, past, fused_head))
            if not is_last:
                cache = TrainingCache.extend(cache, *recorded_key_values(answer_cache), turn.answer.as_past)
        return outputs

    def answer_over_prompt(self, turn: Turn, sequence: torch.Tensor, fused_head: bool = False) -> Any:
        """Steps 1-4 for a turn with nothing before it in its row: both prompt passes over x_1..x_{m-1}, then the
        answer pass, whose layers mix the two passes' keys/values where they read them, from what the passes left
        (`layer_inputs.py`: their keys/values, or their layer inputs to recompute them from). Returns the answer
        pass's output."""
        if turn.prefill.width == 0:  # a one-token instruction: nothing to read twice
            return self.answer_pass(turn.answer, sequence, _pass_cache(None, self.model, record=False), None,
                                    fused_head)
        inputs = turn.prefill.pass_inputs(sequence, None)
        left = {}
        for weight_set in (BIDIRECTIONAL, CAUSAL):
            left[weight_set] = (self._chained_reads(weight_set, inputs) if self.recompute_prompt
                                else self._recorded_key_values(weight_set, self._recording_cache(None), inputs))
        prompt = self._mixes(left, turn.prefill.width)
        cache = recomputing_pass_cache(prompt)
        return self.answer_pass(turn.answer, sequence, cache, turn.prefill.as_past, fused_head)

    def read_twice(self, recording_cache: Callable[[], Cache], **inputs: torch.Tensor) -> KeyValues:
        """Steps 1-3 with the keys/values recorded and mixed at once, for generation and for the turns a later turn
        reads: the bidirectional then the causal prompt pass over `inputs`, each recording into a fresh
        `recording_cache()`; returns the per-layer mix (keys, values)."""
        recorded = {weight_set: self._recorded_key_values(weight_set, recording_cache(), inputs)
                    for weight_set in (BIDIRECTIONAL, CAUSAL)}
        mixed = [mix.key_values() for mix in self._mixes(recorded, recorded[CAUSAL][0].keys.shape[-2])]
        return [keys for keys, _ in mixed], [values for _, values in mixed]

    def _mixes(self, left: dict[WeightSet, list[ChainedRead | HeldKeyValues]], length: int) -> list[PromptMix]:
        """Each layer's mix of what the two prompt passes left, with the active adapter's coefficients (or each
        row's)."""
        coefficients = self.mixer if self.rows is None else self.rows
        key_alpha, value_alpha = coefficients.coefficients()
        return [
            PromptMix(causal, bidirectional, key_alpha[layer], value_alpha[layer], mixed, length)
            for layer, (causal, bidirectional, mixed) in enumerate(
                zip(left[CAUSAL], left[BIDIRECTIONAL], coefficients.mixed)
            )
        ]

    def _chained_reads(self, weight_set: WeightSet, inputs: dict[str, torch.Tensor]) -> list[ChainedRead]:
        """One prompt pass whose decoder layers run without autograd and record nothing, read layer by layer by the
        answer pass through a `PromptPassChain` of what each layer was called with."""
        decoder_layers = [path.modules[-1] for path in self.decoder_layer_paths]
        weights = functools.partial(self.weights, weight_set)
        with capturing_layer_calls(decoder_layers, weights, decoder_of(self.model)) as calls:
            self.prompt_pass(weight_set, _pass_cache(None, self.model, record=False), **inputs)
        chain = PromptPassChain(calls)
        return [ChainedRead(chain, index) for index in range(len(calls))]

    def _recording_cache(self, cache: TrainingCache | None) -> Cache:
        """A prompt pass's cache over what the batch has built so far, recording the pass (and ending it once its
        last layer has recorded, where that is allowed)."""
        return _pass_cache(cache, self.model, record=True, stop_after_last_record=self.stop_early)

    def _recorded_key_values(
        self, weight_set: WeightSet, cache: Cache, inputs: dict[str, torch.Tensor]
    ) -> list[HeldKeyValues]:
        """One prompt pass that records its keys/values into `cache`; the cache hands them over and records no more
        (a checkpointed layer's recomputation writes to it again), so that nothing else holds them. A pass that ends
        at its last layer's keys/values runs that layer without its checkpoint, which it would leave midway."""
        last_layer = self.decoder_layer_paths[-1].modules[-1]
        with compat.checkpointing_paused(last_layer) if self.stop_early else nullcontext():
            self.prompt_pass(weight_set, cache, **inputs)
        self._gather_shards_for_recorded(cache)
        recorded = [HeldKeyValues(keys, values) for keys, values in zip(*recorded_key_values(cache))]
        for layer in cache.layers:
            layer.forget_record()
        return recorded

    def prompt_pass(self, weight_set: WeightSet, cache: Cache, **inputs: Any) -> Any:
        """One prompt pass through the decoder (no LM head: only the keys/values it writes into `cache` are used; a
        cache that stops the pass after its last layer's keys/values ends it there, see `prompt_pass_end.py`).
        Returns the decoder's output, or `None` for a pass that ended there. The second pass of a batch whose rows'
        adapters read it with different masks runs once per mask, over those rows (`None` is returned)."""
        if weight_set == CAUSAL or self.rows is None:
            return self._decoder_pass(weight_set, cache, self.second_pass_attention, inputs)
        kinds = self.rows.rows_by("second_pass_attention")
        if len(kinds) == 1:
            return self._decoder_pass(weight_set, cache, next(iter(kinds)), inputs)
        parts = [(rows, pass_cache_rows(cache, rows)) for rows in kinds.values()]
        for attention, (rows, part) in zip(kinds, parts):
            part_passes = replace(self, rows=self.rows.select(rows))
            part_passes._decoder_pass(weight_set, part, attention, {k: v[rows] for k, v in inputs.items()})
        merge_recorded_rows(cache, parts)
        return None

    def _decoder_pass(
        self, weight_set: WeightSet, cache: Cache, attention: SecondPassAttention | None, inputs: dict[str, Any]
    ) -> Any:
        """The decoder over `inputs` with weight set `weight_set`; the bidirectional weights read with `attention`."""
        is_causal = weight_set == CAUSAL or attention == CAUSAL
        if not is_causal:
            check_attention_reads_is_causal(self.model)
        decoder = decoder_of(self.model)
        output = None
        inputs = masks_for_pass(inputs, self.model, is_causal)
        with self.routed(weight_set), ending_at_complete_record():
            output = decoder(**compat.with_cache(decoder, cache), use_cache=False, is_causal=is_causal, **inputs)
        return output

    def answer_pass(
        self, chunk: Chunk, sequence: torch.Tensor, cache: Cache, past: torch.Tensor | Places | None,
        fused_head: bool = False,
    ) -> Any:
        """
        Step 4: x_m and the answer, causal weights, over `cache`, whose positions `past` marks (its mask, or a packed
        cache's places). Returns the model's output; a recording `cache` then holds the chunk's causal keys/values.

        The output holds the chunk's logits (rows, width, vocab); with `fused_head`, it is TRL's fused-head output of
        the chunk instead (per-token log-probabilities of the chunk's labels, never the logits): the base model
        answers the fused call (`fused_head.ensure_fused_head`) with the chunk's labels, already shifted.
        """
        head = {"fused_lm_head": True, "shift_labels": chunk.labels} if fused_head else {}
        with self.routed(CAUSAL):
            return self.model(
                **masks_for_pass(chunk.pass_inputs(sequence, past), self.model, is_causal=True),
                **compat.with_cache(self.model, cache),
                use_cache=False,
                **head,
            )

    def _gather_shards_for_recorded(self, cache: Cache) -> None:
        """Under FSDP2, the keys/values a prompt pass recorded leave each decoder layer through the cache, not through
        the layer's output (which the last layer's prompt pass never uses): have their gradient gather the layer's
        parameters first (see `sharding.py`)."""
        paths = self.decoder_layer_paths
        if not torch.is_grad_enabled() or len(paths) != len(cache.layers):
            return  # nothing to gather for, or no one-to-one map from cache to decoder layers (`check_sharding`)
        for path, layer in zip(paths, cache.layers):
            if layer.recorded_keys is not None:
                unshard_before_backward((layer.recorded_keys, layer.recorded_values), path.fsdp_unit())


def answer_loss(
    logits: list[torch.Tensor], labels: list[torch.Tensor], num_items_in_batch: int | torch.Tensor | None
) -> torch.Tensor:
    """Next-token cross-entropy, summed over the supervised answer positions of every turn, averaged like
    transformers does (over `num_items_in_batch` when the Trainer gives it); in float32 at least."""
    loss = sum(
        F.cross_entropy(
            turn_logits.to(at_least_float32(turn_logits.dtype)).reshape(-1, turn_logits.shape[-1]),
            turn_labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        for turn_logits, turn_labels in zip(logits, labels)
    )
    if num_items_in_batch is None:
        num_items_in_batch = sum((turn_labels != IGNORE_INDEX).sum() for turn_labels in labels)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _pass_cache(
    cache: TrainingCache | None, model: nn.Module, record: bool, stop_after_last_record: bool = False
) -> Cache:
    """A pass cache over what the batch has built so far (nothing for its first pass)."""
    keys, values = (None, None) if cache is None else (cache.keys, cache.values)
    return pass_cache(num_layers(model), keys, values, record=record, stop_after_last_record=stop_after_last_record)

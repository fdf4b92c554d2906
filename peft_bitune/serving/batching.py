"""Answering several requests in one `generate`: their caches stacked left-padded, each row stopped on its own, and
each row's cache taken back out to be kept.

Each request's prompt is read alone (`ChatEngine.read`: its kept conversation extended, or a full prefill), so the
mixed cache of every row is exactly what it would be unbatched; only decoding runs batched. The caches, each holding
all of its prompt but the last token, are left-padded with zeros to one width under an attention mask that is 0 on the
padding, as `generate` takes left-padded prompts: position ids come from the mask, so every row decodes at its own
positions, and no row attends to another's padding. Batches are static: a batch decodes until its last row has ended
(transformers' `generate` feeds a row that has ended padding tokens until then, and nothing of it is used).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import StoppingCriteria

from ..tuner.caches import BituneCache
from .streaming import StopStrings


def stack_left_padded(caches: Sequence[BituneCache], model: Any) -> BituneCache:
    """One cache holding every row of `caches` (each of one conversation, without sliding-window layers), left-padded
    with zeros to the longest: row i's columns are the last `caches[i].get_seq_length()` ones. The caller records the
    conversation it stands for (ids and mask of the padded prompts)."""
    lengths = [cache.get_seq_length() for cache in caches]
    width = max(lengths)
    keys, values = [], []
    for layer in range(len(caches[0].layers)):
        template = next(cache.layers[layer].keys for cache in caches if cache.layers[layer].keys is not None)
        for stacked, name in ((keys, "keys"), (values, "values")):
            rows = []
            for cache, length in zip(caches, lengths):
                tensor = getattr(cache.layers[layer], name) if length else None
                if tensor is None:  # a one-token prompt leaves nothing to read: all padding
                    tensor = template.new_zeros(*template.shape[:2], 0, template.shape[3])
                rows.append(F.pad(tensor, (0, 0, width - length, 0)))  # [1, kv_heads, width, head_dim]
            stacked.append(torch.cat(rows))  # [rows, kv_heads, width, head_dim]
    batched = BituneCache(config=model.config, owner=model)
    batched.append_key_values(keys, values)
    return batched


def row_cache(
    batched: BituneCache, row: int, start: int, end: int, conversation: list[int], model: Any
) -> BituneCache:
    """Columns `start:end` of one row of a batched cache, as a cache of that conversation alone (the token ids
    `conversation`), copied: keeping it keeps none of the batch's memory alive (the budget counts each cache's own)."""
    cache = BituneCache(config=model.config, owner=model)
    cache.append_key_values(
        [layer.keys[row : row + 1, :, start:end].clone() for layer in batched.layers],
        [layer.values[row : row + 1, :, start:end].clone() for layer in batched.layers],
    )
    ids = torch.tensor([conversation], dtype=torch.long, device=batched.layers[0].keys.device)
    cache.record_conversation(ids, torch.ones_like(ids))
    return cache


@dataclass(eq=False)  # compared and hashed by identity, as any stopping criterion
class RowStops(StoppingCriteria):
    """
    Ends each row of a batch on its own: at its own `max_new_tokens`, at an end-of-sequence token, at one of its stop
    strings (`stop_criteria`), or once its client has left (`cancelled`). `lengths[i]` is how many tokens row i had
    generated when it ended (None while it runs); `generate` then feeds it padding, which nothing uses. `on_end(row,
    sequences)` is called as a row ends (the batch's cache then holds its columns up to its last token but one).
    """

    prompt_width: int  # the columns of the padded prompts
    max_new_tokens: list[int]
    eos_ids: set[int]
    stop_criteria: list[StopStrings | None]
    cancelled: list[threading.Event | None]
    on_end: Callable[[int, torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        self.lengths: list[int | None] = [None] * len(self.max_new_tokens)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_width
        last = input_ids[:, -1].tolist()
        for row, length in enumerate(self.lengths):
            if length is None and self._ends(row, generated, last[row]):
                self.lengths[row] = generated
                if self.on_end is not None:
                    self.on_end(row, input_ids)
        return torch.tensor([length is not None for length in self.lengths], device=input_ids.device)

    def _ends(self, row: int, generated: int, last: int) -> bool:
        cancelled, stop = self.cancelled[row], self.stop_criteria[row]
        if generated >= self.max_new_tokens[row] or last in self.eos_ids or (cancelled is not None and
                                                                             cancelled.is_set()):
            return True
        return stop is not None and stop.add(last)  # called once per token of a running row: `last` is new

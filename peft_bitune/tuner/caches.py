"""Key/value caches of the passes, what a training batch has built so far (`TrainingCache`), and the conversation
cache.

Each pass reads the keys/values built so far and may record its own. Two properties matter, and transformers'
`DynamicCache` has neither:

- reading leaves the cache as it was: the two prompt passes of one instruction must both see the same past, and the
  mix of what they recorded is what gets appended;
- recording is idempotent: under gradient checkpointing a decoder layer is re-run during backward, and a re-run must
  overwrite what the first run wrote instead of appending it a second time.

Both are one layer class, `PassCacheLayer`: an optional fixed prefix, plus an optional record of the last chunk.
In training the prefix of a single turn's answer pass is a `layer_inputs.PromptMix`: the mix of the two prompt passes,
computed inside the reading layer from what those passes left (`layer_inputs.py`), so that it is never held across
layers. A prompt pass of generation feeds nothing but its keys/values, so once the last layer has recorded them the
pass may end there (see `prompt_pass_end.py`). In training it holds every position and is never a sliding-window
layer; sliding-window models still get their window, because transformers builds the sliding mask from the config
over absolute positions. Over a generation cache it mirrors each layer (window and offset) instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .. import compat
from ..utils.messages import first_true
from .checks import (
    Prompts,
    attention_mask_for,
    check_embeddings,
    check_ends_with_real_tokens,
    check_fits_positions,
    check_holes_fit_windows,
    check_same_shape,
)
from .prompt_pass_end import PromptPassComplete


class RecomputedPrefix(Protocol):
    """Keys/values a pass cache layer computes where they are read, inside the reading layer
    (`layer_inputs.PromptMix`)."""

    length: int

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class PassCacheLayer(CacheLayerMixin):
    """
    One decoder layer's cache for one pass (training, or a prompt pass of generation).

    Tensors are `[batch_size, num_kv_heads, seq_len, head_dim]`.

    Args:
        prefix_keys, prefix_values (`torch.Tensor`, *optional*): keys/values every query of the pass may attend to
            before its own chunk. `None` for no prefix.
        record (`bool`): whether `update` keeps the chunk it is given (the prompt passes do, the answer pass does not).
        offset (`int`): positions seen before the prefix (a sliding-window layer of a generation cache keeps only its
            window); the mask is built over absolute positions.
        is_sliding (`bool`): mirrors the layer it reads from, so transformers sizes each mask type from a layer of
            that type.
        stop_after_record (`bool`): raise `PromptPassComplete` once the chunk is recorded (set on the last layer
            where the model allows it: see `prompt_pass_end.py`).
        recomputed_prefix (`RecomputedPrefix`, *optional*): instead of `prefix_keys` and `prefix_values`, the mixed
            prompt the answer pass of a training step reads, computed by `update` (inside the reading layer).
    """

    is_compileable = False

    def __init__(
        self,
        prefix_keys: torch.Tensor | None = None,
        prefix_values: torch.Tensor | None = None,
        record: bool = False,
        offset: int = 0,
        is_sliding: bool = False,
        stop_after_record: bool = False,
        recomputed_prefix: RecomputedPrefix | None = None,
    ) -> None:
        super().__init__()
        if stop_after_record and not record:
            raise ValueError("A pass cache layer can only stop its pass after recording (`record=True`).")
        self.stop_after_record = stop_after_record
        self.offset = offset
        self.is_sliding = is_sliding
        if recomputed_prefix is not None and prefix_keys is not None:
            raise ValueError("A pass cache layer has one prefix: held keys/values or a recomputed mix, not both.")
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.recomputed_prefix = recomputed_prefix
        self.record = record
        self.keys = prefix_keys
        self.values = prefix_values
        self.recorded_keys: torch.Tensor | None = None
        self.recorded_values: torch.Tensor | None = None
        self.is_initialized = prefix_keys is not None or recomputed_prefix is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record:
            # Overwrite, never append: a checkpointing re-run must leave the same state behind.
            self.recorded_keys, self.recorded_values = key_states, value_states
            if self.stop_after_record:
                raise PromptPassComplete
        prefix_keys, prefix_values = self.prefix_keys, self.prefix_values
        if self.recomputed_prefix is not None:
            prefix_keys, prefix_values = self.recomputed_prefix.key_values()
        if prefix_keys is None:
            return key_states, value_states
        return torch.cat([prefix_keys, key_states], dim=-2), torch.cat([prefix_values, value_states], dim=-2)

    def forget_record(self) -> None:
        """Drop the recorded chunk and record no more (the passes have taken it over, `BitunePasses.read_twice`)."""
        self.recorded_keys = self.recorded_values = None
        self.record = self.stop_after_record = False

    def _prefix_length(self) -> int:
        if self.recomputed_prefix is not None:
            return self.recomputed_prefix.length
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    def get_seq_length(self) -> int:
        # What a query of this pass sees before its own chunk; the recorded chunk is output, not past.
        return self.offset + self._prefix_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._prefix_length() + query_length, self.offset

    def get_max_length(self) -> int:
        return -1


def pass_cache(
    num_layers: int,
    keys: list[torch.Tensor] | None = None,
    values: list[torch.Tensor] | None = None,
    record: bool = False,
    stop_after_last_record: bool = False,
) -> Cache:
    """A cache for one pass: optional fixed per-layer prefix keys/values, optionally recording the pass and stopping
    it once the last layer has recorded."""
    if keys is None:
        keys = values = [None] * num_layers
    return Cache(layers=[
        PassCacheLayer(k, v, record=record, stop_after_record=stop_after_last_record and i == num_layers - 1)
        for i, (k, v) in enumerate(zip(keys, values))
    ])


def recomputing_pass_cache(prompt: list[RecomputedPrefix]) -> Cache:
    """The cache of a training step's answer pass over a prompt read twice: each layer computes the mix of the two
    prompt passes where it reads it (`layer_inputs.py`), and records nothing."""
    return Cache(layers=[PassCacheLayer(recomputed_prefix=mix) for mix in prompt])


def reading_pass_cache(cache: DynamicCache, stop_after_last_record: bool = False) -> Cache:
    """A recording pass cache over a generation cache: the pass attends to everything `cache` holds (each layer's
    window, for sliding layers) and records its own keys/values, leaving `cache` untouched."""
    layers = []
    for i, layer in enumerate(cache.layers):
        held = layer.keys.shape[-2]
        layers.append(PassCacheLayer(layer.keys, layer.values, record=True, offset=layer.get_seq_length() - held,
                                     is_sliding=getattr(layer, "is_sliding", False),
                                     stop_after_record=stop_after_last_record and i == len(cache.layers) - 1))
    return Cache(layers=layers)


def pass_cache_rows(cache: Cache, rows: torch.Tensor) -> Cache:
    """A pass cache like `cache` (held prefixes, recording) over rows `rows` of its batch, for the part of a pass that
    runs on those rows alone (`BitunePasses.prompt_pass`)."""
    def picked(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[rows.to(tensor.device)]

    return Cache(layers=[
        PassCacheLayer(picked(layer.prefix_keys), picked(layer.prefix_values), record=layer.record,
                       offset=layer.offset, is_sliding=layer.is_sliding, stop_after_record=layer.stop_after_record)
        for layer in cache.layers
    ])


def merge_recorded_rows(cache: Cache, parts: list[tuple[torch.Tensor, Cache]]) -> None:
    """Record into `cache` what the `(rows, pass_cache_rows(cache, rows))` parts, which cover its rows, recorded."""
    for index, layer in enumerate(cache.layers):
        for name in ("recorded_keys", "recorded_values"):
            first = getattr(parts[0][1].layers[index], name)
            merged = first.new_empty((sum(len(rows) for rows, _ in parts), *first.shape[1:]))
            for rows, part in parts:
                merged[rows.to(merged.device)] = getattr(part.layers[index], name)
            setattr(layer, name, merged)


class BituneCache(DynamicCache):
    """
    The generation cache of a Bitune conversation.

    It is a transformers `DynamicCache` that also keeps the conversation it stands for: the token ids of every row
    (`conversation_ids`, the last `generate` output) and which of them are real (`conversation_mask`). The next turn
    needs them to know where the previous answer ends and the new instruction begins, and to check that it continues
    this very conversation (`check_continuation`): keys/values of another history would be silently wrong.

    `generate` extends the cache in place. To branch a conversation (two different next turns from one point), continue
    each branch from its own `copy.deepcopy` of the cache.
    """

    def __init__(self, *args, owner: torch.nn.Module | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The bidirectional prompt pass of the next turn reaches `sliding_window` positions back, one more than a
        # transformers sliding-window layer keeps.
        compat.keep_one_more_sliding_position(self)
        self.conversation_ids: torch.Tensor | None = None
        self.conversation_mask: torch.Tensor | None = None
        self._owner = weakref.ref(owner) if owner is not None else None

    @property
    def conversation_length(self) -> int:
        """How many input columns of the conversation this cache stands for (0 before anything was recorded)."""
        return 0 if self.conversation_ids is None else self.conversation_ids.shape[1]

    def record_conversation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Name the conversation the cache now stands for: (rows, columns) token ids and their attention mask (1 on
        every token whose keys/values the cache holds as real). For a caller that lays out a conversation itself
        (e.g. a server re-reading a chat history before `prefill`); `prefill` and `generate` record their own."""
        check_same_shape("attention_mask", attention_mask, input_ids.shape)
        self.remember_conversation(input_ids, attention_mask)

    def remember_conversation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """`record_conversation` for values that come from checked prompts (`checks.Prompts`)."""
        self.conversation_ids = input_ids.detach().clone()
        self.conversation_mask = attention_mask.detach().to(torch.bool).clone()

    def checked_continuation(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_limit: int | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Prompts:
        """
        Check, before any compute, that `model` can continue the conversation this cache holds with `input_ids`, and
        return them as checked prompts; raise a `ValueError` otherwise. `input_ids` itself was checked where it
        entered (`checks.check_token_ids`).

        The cache must be `model`'s, `input_ids` must continue its conversation (`check_continuation`), the new tokens
        end every row (left-padded), and the whole fits the model's positions.

        Args:
            model (`torch.nn.Module`): the model that is to continue; it must be the one that made this cache.
            input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): the conversation so far, then the new
                tokens.
            attention_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on real tokens.
            position_limit (`int`, *optional*): the model's positions (`utils.base_model.max_positions`).
            inputs_embeds (`torch.Tensor`, *optional*): the embeddings of every `input_ids` position.
        """
        if not self.belongs_to(model):
            raise ValueError(
                "`cache` was made by another model (or by none): continue a conversation with the model that "
                "started it, from the cache its `generate` or `prefill` returned."
            )
        attention_mask = self.check_continuation(input_ids, attention_mask)
        check_ends_with_real_tokens(attention_mask)
        check_holes_fit_windows(attention_mask, any(self.is_sliding))
        check_fits_positions(int(attention_mask.sum(dim=1).max()), position_limit, "The conversation")
        return Prompts(input_ids, attention_mask, check_embeddings(inputs_embeds, input_ids))

    def check_continuation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """
        Raise a `ValueError` unless `input_ids` is this cache's conversation followed by at least one new token;
        returns the attention mask (all ones when none is given).

        Every column the conversation had is compared: where `attention_mask` marks a real token, it must be the
        cached token, and it must have been real in the cache (a column may be dropped, e.g. padding after an answer
        that ended early, but not added). A server that keeps caches can call this before `generate`, which calls it
        too (through `checked_continuation`).

        Args:
            input_ids (`torch.LongTensor` of shape (batch_size, seq_len)): the conversation so far, then the new
                tokens.
            attention_mask (`torch.Tensor` of shape (batch_size, seq_len), *optional*): 1 on real tokens.
        """
        if self.conversation_ids is None:
            raise ValueError("This BituneCache holds no conversation yet: start one with `generate` or `prefill`.")
        attention_mask = attention_mask_for(input_ids, attention_mask)
        rows, width = self.conversation_ids.shape
        if input_ids.shape[0] != rows:
            raise ValueError(
                f"This cache holds {rows} conversations but `input_ids` has shape {tuple(input_ids.shape)}; continue "
                "each conversation with exactly one row."
            )
        if not self.get_seq_length() <= width < input_ids.shape[1]:
            raise ValueError(
                f"`input_ids` ({input_ids.shape[1]} columns) must be the conversation so far ({width} columns: "
                "the previous output sequences) followed by the new instruction."
            )
        history = input_ids[:, :width]
        real = attention_mask[:, :width].bool()
        cached_ids = self.conversation_ids.to(history.device)
        cached_mask = self.conversation_mask.to(real.device)
        added = first_true(real & ~cached_mask)
        if added is not None:
            row, column = added
            raise ValueError(
                f"`attention_mask` marks column {column} of row {row} as a real token, but it was padding in the "
                "conversation this cache holds: keep the attention mask of the earlier turns (0 on their padding)."
            )
        # A dropped column is one the cache holds as real; every cached token after it was computed with it in
        # view, so only the end of a row's history (e.g. the padding fed to a finished row) may be dropped.
        dropped = cached_mask & ~real
        kept_later = real.flip(-1).long().cummax(-1).values.flip(-1).bool()  # a real column at or after each one
        hole = first_true(dropped & torch.cat([kept_later[:, 1:], torch.zeros_like(real[:, :1])], dim=1))
        if hole is not None:
            row, column = hole
            raise ValueError(
                f"`attention_mask` drops column {column} of row {row}, a real token of the conversation this cache "
                "holds, but keeps later ones: their cached keys/values were computed with it in view, so the history "
                "cannot be read as if it were absent. Keep the attention mask of the earlier turns (only the end of a "
                "row's history, e.g. padding after an answer that ended early, may be dropped)."
            )
        changed = first_true(real & (history != cached_ids))
        if changed is not None:
            row, column = changed
            raise ValueError(
                f"`input_ids` does not continue the conversation this cache holds: row {row}, column {column} is "
                f"{int(history[row, column])}, the cache holds {int(cached_ids[row, column])}. Pass the previous "
                "output sequences unchanged, then the new tokens. `generate` extends the cache in place, so a cache "
                "cannot go back to an earlier point: to branch a conversation, continue each branch from its own "
                "`copy.deepcopy(cache)`, taken at the branch point; to edit the history, start a new conversation."
            )
        return attention_mask

    def append_key_values(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Append per-layer keys/values (the mixed prompt, or cache rows a server lays out) through each layer's own
        `update`, which keeps its bookkeeping (a sliding-window layer keeps its window and counts what it dropped)
        exactly as a forward would."""
        if len(keys) != len(self.layers):
            raise RuntimeError(
                f"{len(keys)} layers of keys/values cannot extend a cache of {len(self.layers)} layers."
            )
        for layer_idx, (layer_keys, layer_values) in enumerate(zip(keys, values)):
            self.update(layer_keys, layer_values, layer_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` (repeats allowed): their keys/values (each layer's own selection) and their
        record of the conversation, so that the next turn continues exactly these rows, as if they had run alone."""
        super().batch_select_indices(indices)
        if self.conversation_ids is not None:
            self.conversation_ids = self.conversation_ids[indices.to(self.conversation_ids.device)]
            self.conversation_mask = self.conversation_mask[indices.to(self.conversation_mask.device)]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (e.g. for `num_beams`), its record of the conversation too."""
        super().batch_repeat_interleave(repeats)
        if self.conversation_ids is not None:
            self.conversation_ids = self.conversation_ids.repeat_interleave(repeats, dim=0)
            self.conversation_mask = self.conversation_mask.repeat_interleave(repeats, dim=0)

    def belongs_to(self, model: torch.nn.Module) -> bool:
        """Whether this cache was made by `model` (the keys of another model would fit its shapes by accident)."""
        return self._owner is not None and self._owner() is model


def recorded_key_values(cache: Cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The keys and values a prompt pass recorded, one tensor per layer."""
    layers = cache.layers
    if any(layer.recorded_keys is None for layer in layers):
        missing = [i for i, layer in enumerate(layers) if layer.recorded_keys is None]
        raise RuntimeError(
            f"The prompt pass stored no keys/values for layers {missing}: this model does not write its KV cache "
            "through the cache's `update` method, which Bitune needs."
        )
    return [layer.recorded_keys for layer in layers], [layer.recorded_values for layer in layers]


@dataclass
class TrainingCache:
    """
    The keys/values a training batch has built so far, one tensor per layer, with its mask: what the later turns of a
    multi-turn row read (a single turn's prompt is mixed where it is read instead, see `layer_inputs.py`).

    It is kept left-padded (each row's real positions at the right end), so that the next chunk, right-padded, gives
    each row one contiguous run of real tokens: all that transformers' mask machinery needs (see `layout.py`).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: Any  # (rows, width) 1 on real positions; a packed batch's `packing.Places`

    @classmethod
    def extend(
        cls,
        cache: TrainingCache | None,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: Any,
    ) -> TrainingCache:
        """Append a chunk; a right-padded chunk after a cache is padded to the left again (a gather per layer). A
        packed batch's cache has no padding: its `mask` is each key's place (`packing.Places`), appended as it is."""
        if cache is None:
            return cls(keys, values, mask)
        keys = [torch.cat([old, new], dim=-2) for old, new in zip(cache.keys, keys)]
        values = [torch.cat([old, new], dim=-2) for old, new in zip(cache.values, values)]
        if not isinstance(mask, torch.Tensor):
            return cls(keys, values, cache.mask.then(mask))
        mask = torch.cat([cache.mask, mask], dim=1)
        repadded = repad_left(mask, *keys, *values)
        count = len(keys)
        return cls(list(repadded[1 : 1 + count]), list(repadded[1 + count :]), repadded[0])


def repad_left(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """
    Pad each row on the left: move its real positions to the right end (padding first, order kept) and drop columns
    that are padding in every row. `mask` is (rows, seq); each tensor is (rows, heads, seq, head_dim). Returns the
    mask, then the tensors.
    """
    order = torch.sort(mask.int(), dim=1, stable=True).indices
    drop = int((mask == 0).sum(dim=1).min())
    order = order[:, drop:]
    repadded = [mask.gather(1, order)]
    for tensor in tensors:
        index = order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
        repadded.append(tensor.gather(2, index))
    return tuple(repadded)

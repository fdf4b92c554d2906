"""
Batches whose rows use different adapters (PEFT's `adapter_names`, one adapter name per row).

PEFT's LoRA routes each row to its adapter inside every layer. A Bitune adapter is more than per-layer weights: it
reads each prompt twice with its two weight sets and mixes the two caches with its own scalars, in passes whose
lengths depend on the batch. So the rows are grouped by adapter, each group runs the ordinary path of that adapter on
exactly its rows (the same columns and padding), and the outputs are put back in row order: every row gets what its
adapter gives it when its group runs alone, to the bit.

This module holds the bookkeeping (which rows, and how their outputs and caches go back together); `BituneModel`
runs the groups.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .. import compat
from ..constants import IGNORE_INDEX
from .caches import BituneCache
from .mixing import at_least_float32

# PEFT's name for the rows of a mixed batch that run without any adapter.
BASE_ADAPTER = "__base__"


@dataclass(frozen=True)
class AdapterGroup:
    """The rows of a batch that use one adapter.

    Args:
        adapter (`str`): a Bitune adapter name.
        rows (`torch.LongTensor` of shape (group_size,)): the group's rows in the batch, ascending.
    """

    adapter: str
    rows: torch.Tensor


def adapter_groups(
    adapter_names: Any, batch_size: int, known: Sequence[str], training: bool
) -> list[AdapterGroup]:
    """Check `adapter_names` (one name per row) before any work and group the rows by adapter, in the order of each
    adapter's first row."""
    if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
        raise TypeError(
            f"`adapter_names` must be a list with one adapter name per row, got {type(adapter_names).__name__}."
        )
    if training:
        raise ValueError(
            "Cannot pass `adapter_names` when the model is in training mode (PEFT's LoRA refuses it too): call "
            "`model.eval()` first; to train several adapters, train each one with `set_adapter`."
        )
    if len(adapter_names) != batch_size:
        raise ValueError(
            f"`adapter_names` has {len(adapter_names)} names for a batch of {batch_size} rows: give one adapter "
            "name per row (per prompt in `generate`, also with `num_beams` or `num_return_sequences`)."
        )
    unknown = sorted({str(name) for name in adapter_names} - {*known, BASE_ADAPTER})
    if unknown:
        raise ValueError(
            f"`adapter_names` names adapters {unknown} that this model does not have: {sorted(known)} (or "
            f"{BASE_ADAPTER!r} for the base model)."
        )
    order = list(dict.fromkeys(adapter_names))
    return [
        AdapterGroup(name, torch.tensor([i for i, n in enumerate(adapter_names) if n == name], dtype=torch.long))
        for name in order
    ]


# The arguments of `forward`, `prefill` and `generate` that hold one entry per row, split with the rows.
PER_ROW_ARGUMENTS = ("input_ids", "attention_mask", "inputs_embeds", "labels", "prompt_mask", "position_ids")



def split_arguments(arguments: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The arguments of one group: the rows `rows` of each per-row argument, the others as they are."""
    return {
        name: value[rows.to(value.device)] if name in PER_ROW_ARGUMENTS and isinstance(value, torch.Tensor) else value
        for name, value in arguments.items()
    }


def supervised_tokens(
    labels: torch.Tensor, attention_mask: torch.Tensor | None, prompt_mask: torch.Tensor | None
) -> torch.Tensor:
    """The supervised tokens of a batch, as the Bitune forward counts them: labelled real tokens outside the
    instruction, as a boolean tensor of the labels' shape."""
    supervised = labels != IGNORE_INDEX
    if attention_mask is not None:
        supervised &= attention_mask.to(labels.device).bool()
    if prompt_mask is not None:
        supervised &= ~prompt_mask.to(labels.device).bool()
    return supervised


def supervised_count(
    labels: torch.Tensor, attention_mask: torch.Tensor | None, prompt_mask: torch.Tensor | None
) -> torch.Tensor:
    """How many tokens `supervised_tokens` marks."""
    return supervised_tokens(labels, attention_mask, prompt_mask).sum()


def next_token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor, prompt_mask: torch.Tensor | None
) -> torch.Tensor:
    """The summed next-token cross-entropy (in float32 at least) of the tokens `supervised_tokens` marks, from logits
    at every position (the `"__base__"` rows)."""
    supervised = supervised_tokens(labels, attention_mask, prompt_mask)
    targets = labels.masked_fill(~supervised, IGNORE_INDEX)[:, 1:]
    scores = logits[:, :-1]
    scores = scores.to(at_least_float32(scores.dtype))
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def check_mixed_generation(kwargs: dict[str, Any], num_groups: int) -> None:
    """Refuse, before any prompt is read, the `generate` arguments a mixed-adapter batch cannot honour exactly."""
    if num_groups > 1 and kwargs.get("streamer") is not None:
        raise ValueError("A `streamer` cannot follow a batch whose rows use several adapters: they are decoded one "
                         "adapter after another. Stream each adapter's rows in a call of their own.")
    if kwargs.get("prefix_allowed_tokens_fn") is not None:
        raise ValueError("`prefix_allowed_tokens_fn` is not supported with `adapter_names`: its `batch_id` would "
                         "count the rows of one adapter's group, not the batch's; generate each adapter's rows apart.")
    other = sorted(name for name, value in kwargs.items()
                   if isinstance(value, torch.Tensor) and name not in PER_ROW_ARGUMENTS)
    if other:
        raise ValueError(f"`{other[0]}` cannot be split by rows for `adapter_names`: pass only `input_ids`, "
                         "`attention_mask` and `inputs_embeds` as tensors.")


def pad_token_of(generation_config: Any, widths: list[int]) -> int:
    """The token that pads a group's sequences to the batch's width: the pad token, else the first EOS token, as
    `generate` pads finished rows."""
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    if pad is None:
        if len(set(widths)) == 1:
            return 0  # nothing to pad
        raise ValueError(
            "The adapters' groups stopped at different lengths and there is no `pad_token_id` (nor `eos_token_id`) "
            "to pad the shorter ones: pass `pad_token_id`."
        )
    return int(pad)


def expanded_rows(rows: torch.Tensor, per_row: int) -> torch.Tensor:
    """The output rows of input rows `rows` when each input row gives `per_row` output rows (beams, return
    sequences), in transformers' order."""
    return (rows[:, None] * per_row + torch.arange(per_row)).reshape(-1)


def scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int) -> torch.Tensor:
    """One tensor of `batch_size` rows from `(rows, tensor)` parts that cover every row once."""
    first = parts[0][1]
    merged = first.new_zeros((batch_size, *first.shape[1:]))
    for rows, tensor in parts:
        merged[rows.to(merged.device)] = tensor
    return merged


def pad_columns(sequences: torch.Tensor, width: int, pad_token_id: int) -> torch.Tensor:
    """`sequences` padded on the right with `pad_token_id` to `width` columns."""
    missing = width - sequences.shape[1]
    if missing == 0:
        return sequences
    return torch.cat([sequences, sequences.new_full((sequences.shape[0], missing), pad_token_id)], dim=1)


def cache_rows(cache: BituneCache, rows: torch.Tensor) -> BituneCache:
    """A new `BituneCache` holding rows `rows` of `cache` (keys/values and the conversation); `cache` is left as it
    is."""
    part = copy.copy(cache)
    part.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in part.layers:
        layer.batch_select_indices(rows.to(layer.keys.device) if layer.keys is not None else rows)
    if cache.conversation_ids is not None:
        part.conversation_ids = cache.conversation_ids[rows.to(cache.conversation_ids.device)]
        part.conversation_mask = cache.conversation_mask[rows.to(cache.conversation_mask.device)]
    return part


def merge_caches(target: BituneCache, parts: list[tuple[torch.Tensor, BituneCache]], batch_size: int) -> None:
    """Make `target` hold the rows of every `(rows, cache)` part, in row order. The parts must hold the same columns
    (the same positions, read by each row's own adapter)."""
    first = parts[0][1]
    lengths = {part.get_seq_length() for _, part in parts}
    widths = {part.conversation_length for _, part in parts}
    if len(lengths) != 1 or len(widths) != 1:
        raise RuntimeError(f"Caches of {sorted(lengths)} positions ({sorted(widths)} columns) cannot be merged.")
    layers = []
    for index, layer in enumerate(first.layers):
        merged = copy.copy(layer)
        if layer.keys is not None and layer.keys.numel() > 0:
            merged.keys = scatter_rows([(rows, part.layers[index].keys) for rows, part in parts], batch_size)
            merged.values = scatter_rows([(rows, part.layers[index].values) for rows, part in parts], batch_size)
        layers.append(merged)
    target.layers[:] = layers
    if first.conversation_ids is not None:
        target.conversation_ids = scatter_rows([(rows, part.conversation_ids) for rows, part in parts], batch_size)
        target.conversation_mask = scatter_rows([(rows, part.conversation_mask) for rows, part in parts], batch_size)


def merged_output(
    outputs: list[Any], group_rows: list[torch.Tensor], sequences: torch.Tensor, cache: Any, batch_size: int
) -> Any:
    """The groups' `generate` outputs (`return_dict_in_generate=True`) as one, in row order: the merged sequences and
    cache, and every other field put back in its rows (`merged_rows`)."""
    first = outputs[0]
    first_cache = compat.output_cache(first)
    fields = {}
    for name, value in first.items():
        if name == "sequences":
            fields[name] = sequences
        elif value is first_cache:
            fields[name] = cache
        else:
            fields[name] = merged_rows(name, [output[name] for output in outputs], group_rows, batch_size)
    return type(first)(**fields)


def merged_rows(name: str, values: list[Any], group_rows: list[torch.Tensor], batch_size: int) -> Any:
    """One value of a `generate` output field from the groups' values, in row order: a tensor's rows (each input row
    gives as many as the tensor has per group row: beams, return sequences) at their rows, and tuples (per step, per
    layer) element by element. Beam indices are padded with -1 beyond a sequence's steps, as transformers pads them.
    Per-step fields of groups that decoded different numbers of steps cannot be lined up, and are refused."""
    if isinstance(values[0], torch.Tensor):
        if name == "beam_indices":
            steps = max(value.shape[1] for value in values)
            values = [pad_columns(value, steps, -1) for value in values]
        per_row = values[0].shape[0] // len(group_rows[0])
        parts = [(expanded_rows(rows, per_row), value) for rows, value in zip(group_rows, values)]
        return scatter_rows(parts, batch_size * per_row)
    if len({len(value) for value in values}) != 1:
        raise ValueError(
            f"`{name}` cannot be returned for this mixed-adapter batch: its adapters' rows stopped after different "
            f"numbers of steps ({sorted({len(value) for value in values})}), and a step one group never ran has no "
            "value. Generate each adapter's rows in a call of their own, or leave the per-step outputs off."
        )
    return tuple(merged_rows(name, list(items), group_rows, batch_size) for items in zip(*values))

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

from .. import compat
from ..constants import IGNORE_INDEX
from .caches import BituneCache

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
    if BASE_ADAPTER in adapter_names:
        raise ValueError(
            f"`adapter_names` holds {BASE_ADAPTER!r} (rows without an adapter), which Bitune does not run in a mixed "
            "batch: run those rows in a batch of their own inside `with model.disable_adapter():`."
        )
    unknown = sorted({str(name) for name in adapter_names} - set(known))
    if unknown:
        raise ValueError(f"`adapter_names` names adapters {unknown} that this model does not have: {sorted(known)}.")
    order = list(dict.fromkeys(adapter_names))
    return [
        AdapterGroup(name, torch.tensor([i for i, n in enumerate(adapter_names) if n == name], dtype=torch.long))
        for name in order
    ]


# The arguments of `forward`, `prefill` and `generate` that hold one entry per row, split with the rows.
PER_ROW_ARGUMENTS = ("input_ids", "attention_mask", "inputs_embeds", "labels", "prompt_mask", "position_ids")

# `generate` outputs made of one entry per decoding step, for each row: groups that stop at different steps have
# different numbers of them, and a finished row's entries would belong to steps its group never ran.
PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def split_arguments(arguments: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The arguments of one group: the rows `rows` of each per-row argument, the others as they are."""
    return {
        name: value[rows.to(value.device)] if name in PER_ROW_ARGUMENTS and isinstance(value, torch.Tensor) else value
        for name, value in arguments.items()
    }


def supervised_count(
    labels: torch.Tensor, attention_mask: torch.Tensor | None, prompt_mask: torch.Tensor | None
) -> torch.Tensor:
    """The supervised tokens of a batch, as the Bitune forward counts them: labelled real tokens outside the
    instruction."""
    supervised = labels != IGNORE_INDEX
    if attention_mask is not None:
        supervised &= attention_mask.to(labels.device).bool()
    if prompt_mask is not None:
        supervised &= ~prompt_mask.to(labels.device).bool()
    return supervised.sum()


def check_mixed_generation(kwargs: dict[str, Any], generation_config: Any, num_groups: int) -> None:
    """Refuse, before any prompt is read, the `generate` arguments a mixed-adapter batch cannot honour exactly."""
    asked = [name for name in PER_STEP_OUTPUTS if kwargs.get(name, getattr(generation_config, name, False))]
    if asked:
        raise ValueError(
            f"`{asked[0]}=True` is not supported with `adapter_names`: each adapter's rows are decoded in a group of "
            "their own, and groups stop at different steps, so per-step outputs cannot be lined up exactly. Generate "
            "each adapter's rows in a batch of their own (`set_adapter`) for per-step outputs."
        )
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
    outputs: list[Any], rows: list[torch.Tensor], sequences: torch.Tensor, cache: Any, num_rows: int
) -> Any:
    """The groups' `generate` outputs (`return_dict_in_generate=True`) as one, in row order: the merged sequences and
    cache, and each per-row field put back in its rows (beam indices padded with -1 beyond a sequence's steps, as
    transformers pads them)."""
    first = outputs[0]
    first_cache = compat.output_cache(first)
    fields = {}
    for name, value in first.items():
        if name == "sequences":
            fields[name] = sequences
        elif value is first_cache:
            fields[name] = cache
        elif name == "sequences_scores":
            fields[name] = scatter_rows([(r, output[name]) for r, output in zip(rows, outputs)], num_rows)
        elif name == "beam_indices":
            steps = max(output[name].shape[1] for output in outputs)
            padded = [pad_columns(output[name], steps, -1) for output in outputs]
            fields[name] = scatter_rows(list(zip(rows, padded)), num_rows)
        else:
            raise RuntimeError(f"`generate` returned `{name}`, which a mixed-adapter batch does not merge.")
    return type(first)(**fields)

"""
Packed rows (TRL's `packing=True`, `padding_free=True`): several examples in one row, each read as its own instruction
and answer, with no padding computed.

An example starts wherever a row's `position_ids` do not continue the previous token's, as transformers reads them
(`masking_utils.find_packed_sequence_indices`); TRL's padding-free collator states the same boundaries as
`cu_seq_lens_*`/`max_length_*` (flash attention's variable-length kernels) and `seq_idx`, which must agree.

Each pass of a packed batch is one row of the real tokens of its kind (`layout.py`), so transformers cannot build its
mask from the input's `position_ids`: every pass gets a 4D mask built here from each query's and each key's example
and position, by the rules transformers applies to a padded row (causal or bidirectional, sliding windows by layer
type). Positions restart in every example, so a sliding window is measured in positions, not in columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..utils.base_model import sliding_window_layers, text_config

# The forward's arguments that describe where packed examples start (besides `position_ids`), as TRL's padding-free
# collator gives them.
BOUNDARY_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class PackedExamples:
    """
    The examples of a packed batch, in order (row by row, left to right).

    Args:
        starts (`torch.LongTensor` of shape (examples,)): each example's first token, as an index into the batch's
            flattened (batch * seq_len) tokens.
        lengths (`torch.LongTensor` of shape (examples,)): each example's number of tokens.
        seq_len (`int`): the batch's row length, to name an example's row and columns in messages.
    """

    starts: torch.Tensor
    lengths: torch.Tensor
    seq_len: int

    def describe(self, example: int) -> str:
        """Where example `example` is, for messages."""
        start, length = int(self.starts[example]), int(self.lengths[example])
        row, column = divmod(start, self.seq_len)
        return f"example {example} (row {row}, columns {column}..{column + length - 1})"


def read_packed_examples(kwargs: dict[str, Any], valid: torch.Tensor) -> PackedExamples | None:
    """
    Pop `position_ids` and the packed-boundary arguments from a training forward's `kwargs` and return the packed
    examples they describe, or `None` for ordinary rows (one example per row, positions 0, 1, ... over its real
    tokens). Refuses, naming the place, positions that do not start an example at 0 and boundary arguments that
    disagree with the positions (or with each other).
    """
    position_ids = kwargs.pop("position_ids", None)
    given = {name: kwargs.pop(name) for name in BOUNDARY_ARGUMENTS if kwargs.get(name) is not None}
    for name in BOUNDARY_ARGUMENTS:
        kwargs.pop(name, None)  # `None` values
    if position_ids is None and not given:
        return None
    if position_ids is None:
        position_ids = _positions_from_boundaries(given, valid)
    position_ids = _expanded(position_ids.to(valid.device), valid)
    batch_size, seq_len = valid.shape
    columns = torch.arange(seq_len, device=valid.device)
    row_starts = valid.int().argmax(dim=1)
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    starts_example = valid & ((position_ids != previous + 1) | (columns[None, :] == row_starts[:, None]))
    flat_starts = starts_example.flatten().nonzero().flatten()
    flat_ends = torch.cat([flat_starts[1:], flat_starts.new_tensor([batch_size * seq_len])])
    row_ends = (row_starts + valid.sum(dim=1)) + torch.arange(batch_size, device=valid.device) * seq_len
    # An example ends where the next one starts, or at its row's last real token.
    lengths = torch.minimum(flat_ends, row_ends[flat_starts // seq_len]) - flat_starts
    examples = PackedExamples(starts=flat_starts, lengths=lengths, seq_len=seq_len)
    first_positions = position_ids.flatten()[flat_starts]
    if bool((first_positions != 0).any()):
        example = int((first_positions != 0).nonzero()[0])
        raise ValueError(
            f"`position_ids` start {examples.describe(example)} at {int(first_positions[example])}: every Bitune pass "
            "reads each example from position 0 (0, 1, ... over its tokens; a packed example starts where positions "
            "restart at 0). Give each example the positions 0, 1, ..., or remove `position_ids`."
        )
    _check_boundary_arguments(given, examples)
    if len(flat_starts) == batch_size:
        return None  # one example per row: ordinary rows
    return examples


def _expanded(position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    try:
        return position_ids.expand(valid.shape)
    except RuntimeError:
        raise ValueError(
            f"`position_ids` has shape {tuple(position_ids.shape)} but the input has shape {tuple(valid.shape)}."
        ) from None


def _positions_from_boundaries(given: dict[str, Any], valid: torch.Tensor) -> torch.Tensor:
    """The positions that `cu_seq_lens_*` (or `seq_idx`) describe, for a forward given no `position_ids`."""
    if "cu_seq_lens_q" in given or "cu_seq_lens_k" in given:
        cu_seq_lens = given.get("cu_seq_lens_q", given.get("cu_seq_lens_k")).to(valid.device).long()
        if valid.shape[0] != 1 or int(cu_seq_lens[-1]) != valid.shape[1]:
            raise ValueError(
                f"`cu_seq_lens_*` ({cu_seq_lens.tolist()}) must cover the one row of a padding-free batch, whose "
                f"input has shape {tuple(valid.shape)}; give `position_ids` too, or flatten the batch into one row."
            )
        example = torch.repeat_interleave(torch.arange(len(cu_seq_lens) - 1, device=valid.device),
                                          cu_seq_lens.diff())
    elif "seq_idx" in given:
        example = given["seq_idx"].to(valid.device).long().expand(valid.shape)[0]
    else:
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in given)} alone do not say where packed examples start: give "
            "`position_ids` (restarting at 0 for each example) or `cu_seq_lens_q`."
        )
    starts = torch.cat([example.new_ones(1, dtype=torch.bool), example[1:] != example[:-1]])
    columns = torch.arange(len(example), device=valid.device)
    last_start = torch.cummax(torch.where(starts, columns, 0), dim=0).values
    return (columns - last_start)[None, :].expand(valid.shape)


def _check_boundary_arguments(given: dict[str, Any], examples: PackedExamples) -> None:
    """The boundary arguments TRL's padding-free collator adds must describe the examples the positions give."""
    if not given:
        return
    starts, lengths = examples.starts, examples.lengths
    expected = {
        "cu_seq_lens_q": torch.cat([starts, (starts[-1:] + lengths[-1:])]),
        "max_length_q": int(lengths.max()),
        "seq_idx": torch.repeat_interleave(torch.arange(len(starts), device=starts.device), lengths),
    }
    expected["cu_seq_lens_k"], expected["max_length_k"] = expected["cu_seq_lens_q"], expected["max_length_q"]
    for name, value in given.items():
        want = expected[name]
        if isinstance(want, int):
            agrees = int(value) == want
        else:
            value = value.to(starts.device).long().flatten()
            agrees = value.shape == want.shape and bool((value == want).all())
        if not agrees:
            shown = value.tolist() if isinstance(value, torch.Tensor) else value
            raise ValueError(
                f"`{name}` ({shown}) does not describe the packed examples that `position_ids` give (example starts "
                f"{starts.tolist()}, lengths {lengths.tolist()}): give the boundaries of one packing, as TRL's "
                "padding-free collator makes them, or leave the extra arguments out."
            )


def check_packing_supported(model: Any) -> None:
    """Refuse, before any compute, a model whose attention a packed batch cannot be masked for: the passes hand over
    4D masks, which sdpa and eager attention read; and layer types other than full and sliding-window attention."""
    config = text_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        raise ValueError(
            f"Packed rows are read under sdpa or eager attention, and this model runs `{implementation}`: each Bitune "
            "pass covers its own part of every example, and the passes hand transformers a 4D mask per pass (flash "
            "attention's variable-length kernels cannot be tested on this project's machines yet). Load the model "
            "with `attn_implementation=\"sdpa\"`, or train on padded batches (`padding_free=False`, no packing)."
        )
    sliding = sliding_window_layers(config)
    if any(sliding) and not all(sliding):
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types != {"full_attention", "sliding_attention"}:
            raise ValueError(
                f"Packed rows mask full and sliding-window layers, and this model's layers are of the types "
                f"{sorted(layer_types)}: train it on padded batches (no packing, `padding_free=False`)."
            )


@dataclass(frozen=True)
class Places:
    """Each token's example and position in a packed pass (each (1, tokens)): all a packed mask is made of."""

    examples: torch.Tensor
    positions: torch.Tensor

    def then(self, later: Places) -> Places:
        """These tokens, then `later`'s (a cache, then the chunk that runs over it)."""
        return Places(torch.cat([self.examples, later.examples], dim=1),
                      torch.cat([self.positions, later.positions], dim=1))


@dataclass(frozen=True)
class PackedMask:
    """The attention of a packed pass, before its direction is known: queries `queries` over keys `keys` (the cache
    so far, then the queries' own). `for_pass` makes the 4D mask(s) the model reads."""

    queries: Places
    keys: Places

    def for_pass(self, model: Any, is_causal: bool, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """
        The 4D mask (1, 1, queries, keys) of a pass, or one per layer type for a model with full and sliding-window
        layers (the mapping transformers' decoders accept as `attention_mask`): a query sees keys of its own example
        only, causally (positions up to its own) or all of them, and on a sliding-window layer only those within the
        window, as transformers bounds it (`kv > q - window` causally, `|q - kv| <= window` bidirectionally). Boolean
        for sdpa; for eager, 0 and the dtype's minimum, as transformers' `eager_mask` makes it.
        """
        config = text_config(model)
        same = self.queries.examples[0][:, None] == self.keys.examples[0][None, :]
        distance = self.queries.positions[0][:, None] - self.keys.positions[0][None, :]
        full = same & (distance >= 0) if is_causal else same
        sliding = sliding_window_layers(config)
        if not any(sliding):
            return _as_model_mask(full, config, dtype)
        window = config.sliding_window
        windowed = full & ((distance < window) if is_causal else (distance.abs() <= window))
        if all(sliding):
            return _as_model_mask(windowed, config, dtype)
        return {"full_attention": _as_model_mask(full, config, dtype),
                "sliding_attention": _as_model_mask(windowed, config, dtype)}


def _as_model_mask(allowed: torch.Tensor, config: Any, dtype: torch.dtype) -> torch.Tensor:
    mask = allowed[None, None]
    if config._attn_implementation == "eager":
        return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)
    return mask


def masks_for_pass(inputs: dict[str, Any], model: Any, is_causal: bool) -> dict[str, Any]:
    """A pass's model inputs with a packed chunk's `PackedMask` made into the mask(s) the model reads (other inputs
    as they are)."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, PackedMask):
        return inputs
    embeddings = inputs.get("inputs_embeds")
    dtype = embeddings.dtype if embeddings is not None else model.get_input_embeddings().weight.dtype
    return {**inputs, "attention_mask": mask.for_pass(model, is_causal, dtype)}

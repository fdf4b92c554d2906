"""What Bitune is given, checked before any compute: the base model (before an adapter's weights are created), and
the arguments of a training forward or of `generate`.

The passes cover different parts of each row, so some arguments of a transformers forward cannot be handed on, and
Bitune's prompts and rows have shapes a plain causal LM does not require (left-padded prompts, one contiguous run of
real tokens per row). Each check says what is wrong and how to fix it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..utils.messages import first_true, format_rows
from ..utils.model_config import text_config


def check_fits_positions(longest: int, max_positions: int | None, what: str) -> None:
    """Refuse `what` ("A row", "A prompt") of `longest` tokens if the model has fewer positions: nothing is truncated
    silently."""
    if max_positions is not None and longest > max_positions:
        raise ValueError(
            f"{what} has {longest} tokens, more than the model's {max_positions} positions; shorten it (nothing is "
            "truncated silently)."
        )


def check_mask_shape(input_ids: Any, attention_mask: Any) -> None:
    """Refuse an attention mask whose shape is not that of the token ids it goes with."""
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"`attention_mask` has shape {tuple(attention_mask.shape)} but `input_ids` has {tuple(input_ids.shape)}."
        )


def has_holes(attention_mask: Any) -> Any:
    """
    Which rows of a (batch, seq) attention mask have a hole, as a (batch,) boolean tensor. A hole is padding between
    two real tokens of a row; padding before a row's first real token or after its last one is not a hole, and an
    all-padding row has none. Bitune's passes need each row's real tokens as one contiguous run.
    """
    valid = attention_mask.bool()
    first = valid.int().argmax(dim=1)
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(dim=1)
    return valid.any(dim=1) & (last - first + 1 != valid.sum(dim=1))


def attention_mask_for(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The given attention mask, checked against `input_ids`, or all ones when none is given."""
    if attention_mask is None:
        return torch.ones_like(input_ids)
    check_mask_shape(input_ids, attention_mask)
    return attention_mask


def positions_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Ordinary position ids, as transformers' `generate` computes them: real tokens counted from 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_not_empty(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(
            f"`input_ids` must be a non-empty (batch_size, seq_len) tensor, got shape {tuple(input_ids.shape)}: "
            "give at least one prompt of at least one token."
        )


def check_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_limit: int | None
) -> torch.Tensor:
    """Refuse empty, right-padded, holed or over-long prompts before any compute; returns the attention mask."""
    check_not_empty(input_ids)
    attention_mask = attention_mask_for(input_ids, attention_mask)
    valid = attention_mask.bool()
    lengths = valid.sum(dim=1)
    if bool((lengths == 0).any()):
        rows = format_rows((lengths == 0).nonzero().flatten().tolist())
        raise ValueError(
            f"Prompt rows {rows} are empty (attention_mask all 0); every prompt needs at least one token."
        )
    if not bool(valid[:, -1].all()):
        rows = format_rows((~valid[:, -1]).nonzero().flatten().tolist())
        raise ValueError(
            f"Prompt rows {rows} are right-padded. Bitune generation continues every prompt from its last token, so "
            "prompts must be left-padded: set `tokenizer.padding_side = 'left'`."
        )
    if bool(has_holes(attention_mask).any()):
        raise ValueError("Prompts have padding between real tokens; pad on the left only.")
    check_fits_positions(int(lengths.max()), position_limit, "A prompt")
    return attention_mask


def check_continuation_arguments(labels: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> None:
    """Refuse an instruction/answer boundary in a forward that continues a cache (which runs causally)."""
    if prompt_mask is not None or labels is not None:
        raise ValueError(
            "`cache` continues a sequence causally, so it cannot be combined with `labels` or `prompt_mask` "
            "(a new instruction on top of a cache is multi-turn data, not supported yet)."
        )


def training_sequence(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    position_limit: int | None,
) -> torch.Tensor:
    """
    What a Bitune training forward runs, `input_ids` (batch, seq) or `inputs_embeds` (batch, seq, hidden), after
    refusing before any compute what it cannot run as asked. `kwargs` are the forward's other arguments: the switches
    of the usual output (`return_dict`, `use_cache`) are dropped from it, the rest are checked by
    `check_training_arguments`.
    """
    for unsupported in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(unsupported, None):
            raise NotImplementedError(
                f"`{unsupported}=True` is not supported by the Bitune forward, whose three passes have different "
                "lengths; see `peft_bitune.visualize` for attention maps."
            )
    kwargs.pop("return_dict", None)
    kwargs.pop("use_cache", None)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
    sequence = input_ids if input_ids is not None else inputs_embeds
    if 0 in sequence.shape[:2]:
        raise ValueError(
            f"The batch is empty (input of shape {tuple(sequence.shape)}): give at least one row of at least one "
            "token."
        )
    check_training_arguments(kwargs, sequence.shape[:2], attention_mask, position_limit)
    return sequence


# Arguments of a transformers forward that the Bitune training forward cannot hand to its passes, and why.
_ARGUMENTS_BITUNE_SETS_PER_PASS = {
    "cache_position": "each of the three passes has its own cache positions, which Bitune computes",
    "logits_to_keep": "the answer pass already computes logits at the answer positions only (the output is zero "
    "before them), and the loss needs all of them",
    "token_type_ids": "it is not split into the instruction and answer passes",
}


def check_training_arguments(
    kwargs: dict[str, Any], shape: tuple[int, int], attention_mask: torch.Tensor | None, position_limit: int | None
) -> None:
    """
    Refuse, before any compute, what the training forward cannot run as asked. Its passes cover different parts of
    each row, so an argument of the model's forward would reach only one of them: none is passed on. `position_ids`
    are accepted only when they are the ordinary ones every pass uses anyway, `logits_to_keep` only as 0 (all), and
    `None` values; everything else is refused by name. Rows longer than the model's positions are refused, as
    `generate` does.
    """
    valid = torch.ones(shape, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if position_limit is not None and shape[1] > position_limit:
        check_fits_positions(int(valid.sum(dim=1).max()), position_limit, "A row")
    for name, value in kwargs.items():
        if value is None or (name == "logits_to_keep" and isinstance(value, int) and value == 0):
            continue
        if name == "position_ids":
            _check_ordinary_positions(value, valid)
            continue
        reason = _ARGUMENTS_BITUNE_SETS_PER_PASS.get(
            name, "it runs each row in three passes of different lengths, and the argument would reach only one"
        )
        raise ValueError(f"The Bitune training forward does not accept `{name}`: {reason}. Remove it.")


def _check_ordinary_positions(position_ids: torch.Tensor, valid: torch.Tensor) -> None:
    """Accept `position_ids` only where they are the positions every pass gets anyway: 0, 1, ... over each row's real
    tokens (padding ignored)."""
    valid = valid.to(position_ids.device)
    try:
        position_ids = position_ids.expand(valid.shape)
    except RuntimeError:
        raise ValueError(
            f"`position_ids` has shape {tuple(position_ids.shape)} but the input has shape {tuple(valid.shape)}."
        ) from None
    ordinary = valid.long().cumsum(dim=1) - 1
    differ = first_true(valid & (position_ids != ordinary))
    if differ is not None:
        row, column = differ
        raise ValueError(
            f"`position_ids` differ from the ordinary positions (0, 1, ... over each row's real tokens) that every "
            f"Bitune pass uses: row {row}, column {column} is {int(position_ids[row, column])}, not "
            f"{int(ordinary[row, column])}. Positions that restart within a row come from packing several sequences "
            "into one (`packing=True` or `padding_free=True` in TRL), which Bitune does not support: train on padded "
            "batches. Otherwise remove `position_ids`."
        )


def check_base_model_supported(model: Any) -> None:
    """Refuse, before any weights are created, a model Bitune cannot run on."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate") or not hasattr(model, "get_decoder"):
        raise ValueError(
            f"Bitune needs a transformers causal language model (e.g. `AutoModelForCausalLM`), got "
            f"{type(model).__name__}."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"Bitune tunes decoder-only models; {type(model).__name__} is an encoder-decoder model."
        )
    if getattr(text_config(model), "use_cache", None) is None:
        raise ValueError(
            f"Bitune reads the prompt into a KV cache, and {type(model).__name__} has no KV cache support."
        )
    if not hasattr(text_config(model), "num_hidden_layers"):
        raise ValueError(f"Cannot find `num_hidden_layers` in the config of {type(model).__name__}.")

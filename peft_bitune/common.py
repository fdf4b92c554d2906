"""The names, values and tiny helpers that the modules of peft-bitune share.

It imports nothing from the package, so every module can import it: each name is defined here once, and no module
keeps a copy in sync by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

# The PEFT type of Bitune adapters (`adapter_config.json`'s "peft_type"), and PEFT's prefix of the tuner's parameters.
BITUNE_TYPE_NAME = "BITUNE"
BITUNE_PREFIX = "bitune_"

# The two weight sets of a Bitune adapter. Inside the inner PEFT method, the weight set `<set>` of the Bitune adapter
# `<name>` is the adapter "<name>__<set>"; the separator cannot appear in a weight set name.
WeightSet = Literal["causal", "bidirectional"]
CAUSAL: WeightSet = "causal"
BIDIRECTIONAL: WeightSet = "bidirectional"
WEIGHT_SETS: tuple[WeightSet, ...] = get_args(WeightSet)
INNER_SEPARATOR = "__"
# The tuner's attribute (and checkpoint key segment) holding each adapter's mixing scalars.
MIXERS_ATTRIBUTE = "bitune_mixers"

# The allowed values of `BituneConfig.second_pass_attention` and `BituneConfig.multi_turn`.
SecondPassAttention = Literal["bidirectional", "causal"]
SECOND_PASS_ATTENTIONS: tuple[SecondPassAttention, ...] = get_args(SecondPassAttention)
MultiTurnMode = Literal["alternating", "history"]
MULTI_TURN_MODES: tuple[MultiTurnMode, ...] = get_args(MultiTurnMode)

# The label of positions without loss, as in transformers and TRL.
IGNORE_INDEX = -100


def inner_adapter_name(adapter_name: str, weight_set: WeightSet) -> str:
    """Name, inside the inner PEFT method, of one weight set of the Bitune adapter `adapter_name`."""
    return f"{adapter_name}{INNER_SEPARATOR}{weight_set}"


def peft_type_name(peft_type: Any) -> str:
    """The name of a PEFT type, e.g. "LORA", from the `PeftType` member or its string in `adapter_config.json` (a
    member formats as "PeftType.LORA")."""
    return str(getattr(peft_type, "value", peft_type))


def is_bitune_type(peft_type: Any) -> bool:
    """Whether a PEFT type (the `PeftType` member, or its string in `adapter_config.json`) is Bitune's."""
    return peft_type_name(peft_type) == BITUNE_TYPE_NAME


def text_config(model: Any) -> Any:
    """The text part of a model's config (the config itself for a text-only model)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_positions(model: Any) -> int | None:
    """How many positions the model has, if its config says."""
    return getattr(text_config(model), "max_position_embeddings", None)


def num_layers(model: Any) -> int:
    """The number of decoder layers, which is the number of key/value cache layers."""
    return text_config(model).num_hidden_layers


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


def first_true(mask: Any) -> tuple[int, int] | None:
    """The (row, column) of the first true entry of a 2-D boolean tensor, for an error message; `None` if none is."""
    found = mask.nonzero()
    return (int(found[0, 0]), int(found[0, 1])) if len(found) else None


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


def format_rows(rows: Sequence[int], most: int = 8) -> str:
    """Batch or dataset rows for an error message: `[0, 3, 5]`, or the first `most` then `...`."""
    shown = [str(row) for row in rows[:most]] + (["..."] if len(rows) > most else [])
    return "[" + ", ".join(shown) + "]"

"""The names and values every part of peft-bitune shares: the PEFT type, the weight sets and how the inner PEFT method
names them, the label without loss.

It imports nothing from the package, so every module can import it: each name is defined here once.
"""

from __future__ import annotations

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

# The allowed values of `BituneConfig.second_pass_attention` and `BituneConfig.multi_turn` (checked by
# `field_types.check_field_types` from the annotations).
SecondPassAttention = Literal["bidirectional", "causal"]
MultiTurnMode = Literal["alternating", "history"]

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

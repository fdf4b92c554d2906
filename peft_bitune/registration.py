"""Make "BITUNE" a PEFT type, so that `get_peft_model` and `PeftModel.from_pretrained` dispatch to this package.

PEFT has no plugin discovery: `register_peft_method` only accepts names that are already members of the closed
`PeftType` enum, and PEFT and transformers call `peft_type.value`, so a plain string key is not enough. This module is
the only place that touches PEFT's registries. It adds the enum member, then registers through PEFT's own function.
"""

from __future__ import annotations

from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils import PeftType, register_peft_method

BITUNE_TYPE_NAME = "BITUNE"
BITUNE_PREFIX = "bitune_"


def _add_peft_type_member(name: str) -> PeftType:
    """Add `name` to the `PeftType` enum (a `str` enum), the way the enum machinery builds its own members."""
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    member.__init__(name)
    # Set the class attribute before the member maps: `EnumType.__setattr__` refuses to rebind names it knows.
    setattr(PeftType, name, member)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    return member


def register_bitune() -> None:
    """Register `BituneConfig`/`BituneModel` under the PEFT type "BITUNE". Safe to call more than once."""
    from .config import BituneConfig
    from .model import BituneModel

    peft_type = _add_peft_type_member(BITUNE_TYPE_NAME)
    if PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) is BituneConfig:
        return
    register_peft_method(
        name=BITUNE_TYPE_NAME.lower(), config_cls=BituneConfig, model_cls=BituneModel, prefix=BITUNE_PREFIX
    )

"""Make "BITUNE" a PEFT type, so that `get_peft_model` and `PeftModel.from_pretrained` dispatch to this package.

PEFT has no plugin discovery: `register_peft_method` only accepts names that are already members of the closed
`PeftType` enum. This module is the only place that touches PEFT's registries: it adds the enum member (see
`compat.add_peft_type`), then registers through PEFT's own function.
"""

from __future__ import annotations

from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils import register_peft_method

from . import compat
from .constants import BITUNE_PREFIX, BITUNE_TYPE_NAME
from .tuner.config import BituneConfig
from .tuner.model import BituneModel


def register_bitune() -> None:
    """Register `BituneConfig`/`BituneModel` under the PEFT type "BITUNE". Safe to call more than once."""
    peft_type = compat.add_peft_type(BITUNE_TYPE_NAME)
    if PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) is BituneConfig:
        return
    register_peft_method(
        name=BITUNE_TYPE_NAME.lower(), config_cls=BituneConfig, model_cls=BituneModel, prefix=BITUNE_PREFIX
    )

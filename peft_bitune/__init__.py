"""Bitune for PEFT: `get_peft_model(model, BituneConfig(...))` reads the instruction twice (causal and bidirectional
weights), mixes the two KV caches with learned per-layer scalars, and trains and generates on the answer.

Importing this package registers the "BITUNE" PEFT type, which `PeftModel.from_pretrained` needs to load an adapter.
"""

from .config import BituneConfig
from .mixing import BituneKVMixer, mix_key_values
from .model import BIDIRECTIONAL, CAUSAL, BituneModel, inner_adapter_name
from .registration import register_bitune

__all__ = [
    "BIDIRECTIONAL",
    "CAUSAL",
    "BituneConfig",
    "BituneKVMixer",
    "BituneModel",
    "inner_adapter_name",
    "mix_key_values",
    "register_bitune",
]

register_bitune()

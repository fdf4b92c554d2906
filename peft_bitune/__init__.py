"""Bitune for PEFT: `get_peft_model(model, BituneConfig(...))` reads the instruction twice (causal and bidirectional
weights), mixes the two KV caches with learned per-layer scalars, and trains and generates on the answer.

Importing this package registers the "BITUNE" PEFT type, which `PeftModel.from_pretrained` needs to load an adapter.
It installs no hook. Adapters are saved by PEFT (safetensors by default, a pickle with `safe_serialization=False`),
and their weights files are checked before PEFT loads them (`persistence/weights_files.py`).
"""

from .constants import BIDIRECTIONAL, CAUSAL, inner_adapter_name
from .persistence.hub import push_to_hub
from .registration import register_bitune
from .training.callbacks import BituneMixingCallback, BituneMixingWarmupCallback
from .training.optimizers import bitune_parameter_groups, create_bitune_optimizer
from .tuner.caches import BituneCache
from .tuner.config import BituneConfig
from .tuner.mixing import BituneKVMixer, mix_key_values
from .tuner.model import BituneModel

__all__ = [
    "BIDIRECTIONAL",
    "BituneCache",
    "CAUSAL",
    "BituneConfig",
    "BituneKVMixer",
    "BituneMixingCallback",
    "BituneMixingWarmupCallback",
    "BituneModel",
    "bitune_parameter_groups",
    "create_bitune_optimizer",
    "inner_adapter_name",
    "mix_key_values",
    "push_to_hub",
    "register_bitune",
]

register_bitune()

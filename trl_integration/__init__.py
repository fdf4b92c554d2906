"""Train Bitune adapters with TRL: `BituneSFTTrainer` (an `SFTTrainer`) and `BituneSFTConfig` (an `SFTConfig`).

Importing this package imports `peft_bitune`, which registers the "BITUNE" PEFT type.
"""

from .config import BituneSFTConfig
from .trainer import BituneSFTTrainer

__all__ = ["BituneSFTConfig", "BituneSFTTrainer"]

"""Train Bitune adapters with TRL: `BituneSFTTrainer` (an `SFTTrainer`) and `BituneSFTConfig` (an `SFTConfig`) for
supervised fine-tuning; `BituneDPOTrainer`, `BituneKTOTrainer`, `BituneGRPOTrainer` and `BituneRLOOTrainer` (TRL's
trainers, with the reference an exact copy of the policy's adapter) for preference and RL tuning after it.

Importing this package imports `peft_bitune`, which registers the "BITUNE" PEFT type.
"""

from .config import BituneSFTConfig
from .policy_trainers import BituneDPOTrainer, BituneGRPOTrainer, BituneKTOTrainer, BituneRLOOTrainer
from .trainer import BituneSFTTrainer

__all__ = [
    "BituneDPOTrainer",
    "BituneGRPOTrainer",
    "BituneKTOTrainer",
    "BituneRLOOTrainer",
    "BituneSFTConfig",
    "BituneSFTTrainer",
]

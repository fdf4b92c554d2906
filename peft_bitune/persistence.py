"""How a Bitune adapter's weights map to checkpoint keys (save, load, Hub). Mixed into `BituneModel`."""

from __future__ import annotations


class BituneCheckpointMixin:
    """Checkpoint-key hooks of `BituneModel` (PEFT calls them through `PEFT_TYPE_TO_TUNER_MAPPING`)."""

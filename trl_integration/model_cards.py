"""The model card every Bitune trainer writes: TRL's, made right for a Bitune adapter."""

from __future__ import annotations

import os
from typing import Any

from peft_bitune.persistence.model_card import write_trl_model_card
from peft_bitune.tuner.find_tuner import find_bitune_tuner


class BituneModelCardMixin:
    """`create_model_card` of the Bitune trainers; mixed in before the TRL trainer class (which writes the card)."""

    def _bitune_recipe(self) -> dict[str, Any]:
        """The training options beyond the paper that differ from their defaults, for the card (none by default)."""
        return {}

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """
        TRL's model card, made right for a Bitune adapter: it is named after the output (the Hub repo or the output
        folder) when `model_name` is not given, names the base model also when that is a local folder, and replaces
        TRL's `pipeline(...)` quick start (which cannot load a Bitune adapter) with the lines that do.
        """
        location = getattr(self, "hub_model_id", None) or self.args.hub_model_id or self.args.output_dir
        if model_name is None:
            model_name = os.path.basename(str(location).rstrip("/"))
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            bitune = find_bitune_tuner(self.accelerator.unwrap_model(self.model))
            config = bitune.peft_config[bitune.active_adapter]
            write_trl_model_card(self.args.output_dir, config, location, self._bitune_recipe())

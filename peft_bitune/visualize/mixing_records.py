"""
Reading what a Bitune adapter learned about mixing its two prompt caches: the per-layer mixing coefficients of a model
or of a saved adapter (read with `persistence/checkpoint_keys.py`, without loading any model), and their history over
training, as `BituneMixingCallback` logged it. Only torch is needed; drawing them is in `plots.py`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftModel
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

from ..constants import is_bitune_type
from ..persistence.checkpoint_keys import saved_mixing_scalars
from ..training.callbacks import layer_log_key, mean_log_key
from ..tuner.config import BituneConfig
from ..tuner.find_tuner import require_bitune_tuner
from ..tuner.mixing import BituneKVMixer
from ..tuner.model import BituneModel


def mixing_coefficients(
    source: PeftModel | BituneModel | str | os.PathLike, adapter_name: str | None = None
) -> dict[str, torch.Tensor]:
    """
    The learned mixing coefficients alpha (weight of the bidirectional cache) per layer, for keys and values.

    Args:
        source (`PeftModel`, `BituneModel` or a directory): a Bitune model, or a directory written by its
            `save_pretrained` (read without loading any model: `adapter_config.json` and `adapter_model.safetensors`).
        adapter_name (`str`, *optional*): for a model, which Bitune adapter (defaults to the active one); for a
            directory, the sub-folder PEFT saves a non-default adapter in (defaults to the directory itself).

    Returns:
        `{"keys": alphas, "values": alphas}`, each a float32 CPU tensor of shape (num_layers,).
    """
    if isinstance(source, (str, os.PathLike)):
        return _saved_mixing_coefficients(source, adapter_name)
    bitune = require_bitune_tuner(source, "to read its mixing coefficients")
    coefficients = bitune.get_mixing_coefficients(adapter_name)
    return {kind: alpha.cpu() for kind, alpha in coefficients.items()}


def _saved_mixing_coefficients(directory: str | os.PathLike, adapter_name: str | None) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, adapter_name) if adapter_name not in (None, "default") else os.fspath(directory)
    config_path, weights_path = os.path.join(path, CONFIG_NAME), os.path.join(path, SAFETENSORS_WEIGHTS_NAME)
    for required in (config_path, weights_path):
        if not os.path.isfile(required):
            raise FileNotFoundError(
                f"{required} does not exist; pass a directory written by a Bitune model's `save_pretrained` (with "
                f"`safe_serialization=True`, the default), or a loaded model."
            )
    with open(config_path, encoding="utf-8") as file:
        config_data = json.load(file)
    if not is_bitune_type(config_data.get("peft_type")):
        raise ValueError(f"{config_path} describes a {config_data.get('peft_type')!r} adapter, not a Bitune one.")
    config = BituneConfig.from_pretrained(path)
    weights = saved_mixing_scalars(weights_path)
    mixer = BituneKVMixer(weights["keys"].numel(), config.mix_init, config.mix_scale, config.mixed_layers)
    mixer.load_state_dict({"key_weights": weights["keys"], "value_weights": weights["values"]})
    key_alpha, value_alpha = mixer.coefficients()
    return {"keys": key_alpha.detach(), "values": value_alpha.detach()}


@dataclass
class MixingHistory:
    """
    The mixing coefficients over training, as `BituneMixingCallback` logged them.

    Attributes:
        steps (`list[int]`): the optimizer step of each log that holds every layer's alphas.
        keys (`torch.Tensor` of shape (len(steps), num_layers)): alpha of the keys per layer at those steps.
        values (`torch.Tensor` of shape (len(steps), num_layers)): alpha of the values per layer at those steps.
        mean_steps (`list[int]`): the step of each log that holds the means (every training log).
        mean_keys (`torch.Tensor` of shape (len(mean_steps),)): mean alpha of the keys over layers.
        mean_values (`torch.Tensor` of shape (len(mean_steps),)): mean alpha of the values over layers.
    """

    steps: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    mean_steps: list[int]
    mean_keys: torch.Tensor
    mean_values: torch.Tensor


def mixing_history(log_history: Sequence[dict[str, Any]] | str | os.PathLike) -> MixingHistory:
    """
    Read the mixing coefficients a Bitune training run logged (`BituneMixingCallback`, which `BituneSFTTrainer` uses).

    Args:
        log_history (`list[dict]`, or a path): `trainer.state.log_history`, or a `trainer_state.json` (or the
            checkpoint folder holding it) that the Trainer saved.

    Returns:
        A `MixingHistory`.
    """
    logs = _log_history(log_history)
    num_layers = 0
    while any(layer_log_key("keys", num_layers) in log for log in logs):
        num_layers += 1
    per_layer = [log for log in logs if layer_log_key("keys", 0) in log]
    means = [log for log in logs if mean_log_key("keys") in log]
    if not means:
        raise ValueError(
            "The log history holds no mixing coefficients (`bitune/...` keys): train with `BituneSFTTrainer`, or add "
            "`peft_bitune.BituneMixingCallback()` to the Trainer's callbacks."
        )

    def table(kind: str) -> torch.Tensor:
        rows = [[log[layer_log_key(kind, layer)] for layer in range(num_layers)] for log in per_layer]
        return torch.tensor(rows, dtype=torch.float32).reshape(len(per_layer), num_layers)

    return MixingHistory(
        steps=[int(log["step"]) for log in per_layer],
        keys=table("keys"),
        values=table("values"),
        mean_steps=[int(log["step"]) for log in means],
        mean_keys=torch.tensor([log[mean_log_key("keys")] for log in means], dtype=torch.float32),
        mean_values=torch.tensor([log[mean_log_key("values")] for log in means], dtype=torch.float32),
    )


def _log_history(source: Sequence[dict[str, Any]] | str | os.PathLike) -> list[dict[str, Any]]:
    if not isinstance(source, (str, os.PathLike)):
        return list(source)
    path = os.path.join(source, "trainer_state.json") if os.path.isdir(source) else os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist; pass `trainer.state.log_history`, a `trainer_state.json`, or a checkpoint folder "
            "that holds one."
        )
    with open(path, encoding="utf-8") as file:
        state = json.load(file)
    if "log_history" not in state:
        raise ValueError(f"{path} has no `log_history`: it is not a `trainer_state.json` written by a Trainer.")
    return state["log_history"]

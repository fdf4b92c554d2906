"""
Separate learning rates for the parts of a Bitune adapter, in the spirit of PEFT's LoRA+
(`peft.optimizers.create_loraplus_optimizer`): the bidirectional weight set and the mixing scalars each train at a
multiple of the base rate, the causal weight set at the base rate.

Why: the two groups start from unusual places. The bidirectional set reads the prompt with a mask the base model never
saw, starting from nothing; the mixing scalars are tiny (`w` ~ 0.01) and, under Adam, a step of the base rate moves
their alpha by up to `lr / mix_scale` (0.15 at 1.5e-3), so on the paper's tasks the alphas leave their start within
about 30 steps (docs/paper_tasks.md). `BituneSFTConfig(bidirectional_lr_ratio=..., mixing_lr_ratio=...)` uses this
module; `create_bitune_optimizer` serves a loop of one's own.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..constants import BIDIRECTIONAL, CAUSAL, inner_adapter_name
from ..tuner.find_tuner import find_bitune_tuner
from ..tuner.model import BituneModel

# The parameter groups, by the part of the adapter they hold.
CAUSAL_GROUP, BIDIRECTIONAL_GROUP, MIXING_GROUP = "causal", "bidirectional", "mixing"
WEIGHT_SET_GROUPS = {CAUSAL: CAUSAL_GROUP, BIDIRECTIONAL: BIDIRECTIONAL_GROUP}


def check_lr_ratio(name: str, ratio: Any) -> None:
    """Refuse a learning-rate multiple that is not a finite positive number, naming the setting."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(
            f"`{name}` must be a finite positive number (a multiple of the base learning rate), got {ratio!r}. "
            "To freeze the mixing scalars, set `train_mixing` to false (a `BituneConfig` field and a bitune-sft flag) "
            "instead of a zero rate."
        )


def parameter_parts(bitune: BituneModel) -> dict[int, str]:
    """
    The part of the adapter each parameter of `bitune` belongs to, keyed by the parameter's `id`: the mixing scalars,
    or the weight set of the inner adapter that holds it. Read from the inner method's layers, whose adapter weights
    are held in dicts keyed by inner adapter name (`adapter_layer_names`): a name pattern would miss a weight stored
    bare, like an IA3 vector (`...ia3_l.default__bidirectional`, with no trailing segment).
    """
    weight_set_of = {
        inner_adapter_name(adapter_name, weight_set): weight_set
        for adapter_name, config in bitune.peft_config.items()
        for weight_set in config.weight_sets
    }
    parts = {id(parameter): MIXING_GROUP for parameter in bitune.bitune_mixers.parameters()}
    for layer in bitune.model.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        for attribute in layer.adapter_layer_names:
            for inner_name, held in getattr(layer, attribute, {}).items():
                if inner_name in weight_set_of:
                    parameters = held.parameters() if isinstance(held, nn.Module) else (held,)
                    parts.update({id(parameter): WEIGHT_SET_GROUPS[weight_set_of[inner_name]]
                                  for parameter in parameters})
    return parts


def bitune_parameter_groups(
    model: nn.Module,
    learning_rate: float,
    bidirectional_lr_ratio: float = 1.0,
    mixing_lr_ratio: float = 1.0,
    weight_decay: float = 0.0,
    decay_parameter_names: Collection[str] | None = None,
) -> list[dict[str, Any]]:
    """
    The trainable parameters of a Bitune model as optimizer parameter groups, each with its `lr` and
    `weight_decay`.

    Args:
        model (`nn.Module`): a model holding a Bitune adapter (a `PeftModel` or the tuner).
        learning_rate (`float`): the base rate, for the causal weight set.
        bidirectional_lr_ratio (`float`): the bidirectional weight set trains at `learning_rate` times this.
        mixing_lr_ratio (`float`): the mixing scalars train at `learning_rate` times this.
        weight_decay (`float`): applied to the parameters named in `decay_parameter_names` (all but the mixing
            scalars when it is `None`: decay would pull every alpha towards 0).
        decay_parameter_names (`Collection[str]`, *optional*): as `Trainer.get_decay_parameter_names` returns them.
    """
    check_lr_ratio("bidirectional_lr_ratio", bidirectional_lr_ratio)
    check_lr_ratio("mixing_lr_ratio", mixing_lr_ratio)
    bitune = find_bitune_tuner(model)
    if bitune is None:
        raise ValueError(
            "Separate learning rates for the Bitune weight sets need a model with a Bitune adapter "
            "(`get_peft_model(model, BituneConfig(...))`); this model has none."
        )
    ratios = {CAUSAL_GROUP: 1.0, BIDIRECTIONAL_GROUP: bidirectional_lr_ratio, MIXING_GROUP: mixing_lr_ratio}
    parts = parameter_parts(bitune)
    groups: dict[tuple[str, bool], list[torch.Tensor]] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        part = parts.get(id(parameter), CAUSAL_GROUP)  # anything else trainable trains at the base rate
        decays = part != MIXING_GROUP if decay_parameter_names is None else name in decay_parameter_names
        groups.setdefault((part, decays), []).append(parameter)
    if bidirectional_lr_ratio != 1.0 and not any(part == BIDIRECTIONAL_GROUP for part, _ in groups):
        raise ValueError(
            f"`bidirectional_lr_ratio={bidirectional_lr_ratio}` applies to the bidirectional weight set, but this "
            "model trains none (`shared_weights=True`, or it is frozen). Leave the ratio at 1."
        )
    if mixing_lr_ratio != 1.0 and not any(part == MIXING_GROUP for part, _ in groups):
        raise ValueError(
            f"`mixing_lr_ratio={mixing_lr_ratio}` applies to the mixing scalars, but this model does not train them "
            "(`train_mixing=False`, or they are frozen). Leave the ratio at 1."
        )
    return [
        {"params": parameters, "lr": learning_rate * ratios[part], "weight_decay": weight_decay if decays else 0.0,
         "name": f"bitune_{part}" + ("" if decays else "_no_decay")}
        for (part, decays), parameters in sorted(groups.items())
    ]


def create_bitune_optimizer(
    model: nn.Module,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    lr: float = 1e-3,
    bidirectional_lr_ratio: float = 1.0,
    mixing_lr_ratio: float = 1.0,
    weight_decay: float = 0.0,
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """
    An optimizer over a Bitune model's trainable parameters with a learning rate per part (see
    `bitune_parameter_groups`), like `peft.optimizers.create_loraplus_optimizer` for LoRA. Pass it to a `Trainer` as
    `optimizers=(optimizer, None)`, or step it in a loop of your own.

    Example:

    ```py
    >>> optimizer = create_bitune_optimizer(model, torch.optim.AdamW, lr=1.5e-3, mixing_lr_ratio=0.1)  # doctest: +SKIP
    ```
    """
    groups = bitune_parameter_groups(model, lr, bidirectional_lr_ratio, mixing_lr_ratio, weight_decay)
    return optimizer_cls(groups, lr=lr, **optimizer_kwargs)

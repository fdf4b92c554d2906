"""What sharded data parallelism (FSDP) needs from the Bitune passes.

Each decoder layer runs three times per training step (the two prompt passes and the answer pass). FSDP2
(`torch.distributed.fsdp.fully_shard`) frees a unit's gathered parameters after each of its forwards, gathers them
again in backward when the gradient reaches that forward's *output*, and reduces and frees them again once the gradient
reaches that forward's *input*. The keys/values of a prompt pass leave a decoder layer through the cache instead of its
output; for the last layer, whose prompt-pass output is never used, that is the only way out, and its key/value
projections would run their backward on freed parameters. `unshard_before_backward` gathers the unit when the gradient
reaches the recorded keys/values; FSDP's own post-backward hook on the layer's input then reduces the gradients and
frees the parameters as usual.

FSDP1 (the `FullyShardedDataParallel` wrapper) needs nothing: it frees a unit after backward once the gradient of its
flat parameter is complete, i.e. after the last of the three passes. The mixing scalars live on the tuner, so they
belong to the unit of the model's root (the PEFT model), gathered for the whole forward and backward; FSDP2 on the
decoder layers without the root would leave them out of the sharding, and `check_sharding` refuses that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import compat

if torch.distributed.is_available():
    from torch.distributed.fsdp import FSDPModule
else:  # builds without distributed support cannot shard

    class FSDPModule:  # noqa: D101  (a stand-in that no module is an instance of)
        pass


@dataclass(frozen=True)
class LayerPath:
    """Where a decoder layer sits in the model: the modules from the base model down to the layer. Found when the
    adapter is added; `fully_shard` comes later (e.g. in `accelerator.prepare`) and turns modules into FSDP units in
    place, so the units are looked up along the path on every forward."""

    modules: tuple[nn.Module, ...]

    @classmethod
    def of(cls, model: nn.Module, qualified_name: str) -> LayerPath:
        modules = [model]
        for name in qualified_name.split(".") if qualified_name else ():
            modules.append(modules[-1].get_submodule(name))
        return cls(tuple(modules))

    def fsdp_unit(self) -> FSDPModule | None:
        """The FSDP2 unit that owns the layer's own parameters: the deepest module of the path that `fully_shard` was
        applied to, or `None` (unsharded, or sharded only above the base model, where the unit's output, the loss,
        keeps it gathered for the whole backward)."""
        return next((module for module in reversed(self.modules) if isinstance(module, FSDPModule)), None)


def unshard_before_backward(tensors: Sequence[torch.Tensor], unit: FSDPModule | None) -> None:
    """Gather `unit`'s parameters when the gradient reaches `tensors` (outputs of `unit` that leave it other than
    through its forward's return value). A no-op outside FSDP2, without gradients, or if the unit is gathered."""
    if unit is None or not torch.is_grad_enabled():
        return
    for tensor in tensors:
        if tensor.requires_grad:
            tensor.register_hook(_Unshard(unit))


class _Unshard:
    """A tensor hook that gathers an FSDP2 unit and passes the gradient on unchanged."""

    def __init__(self, unit: FSDPModule) -> None:
        self.unit = unit

    def __call__(self, grad: torch.Tensor) -> None:
        self.unit.unshard()  # FSDP's own no-op when already gathered


def check_sharding(decoder_layer_paths: Sequence[LayerPath], num_cache_layers: int, mixers: nn.Module) -> None:
    """Refuse, before any compute, an FSDP2 sharding under which Bitune would train wrongly.

    Args:
        decoder_layer_paths (`Sequence[LayerPath]`): where each decoder layer sits in the model.
        num_cache_layers (`int`): the number of key/value cache layers (`num_hidden_layers`).
        mixers (`nn.Module`): the module holding the active adapter's mixing scalars.
    """
    if not any(path.fsdp_unit() is not None for path in decoder_layer_paths):
        return
    if len(decoder_layer_paths) != num_cache_layers:
        raise NotImplementedError(
            f"Bitune under FSDP2 maps each of the {num_cache_layers} cache layers to its decoder layer, but the "
            f"decoder of this model has {len(decoder_layer_paths)} checkpointable layers. Use DDP for this model."
        )
    if not compat.is_fsdp_managed(mixers):
        raise ValueError(
            "The decoder layers are sharded with `fully_shard`, but the Bitune mixing scalars are not: their "
            "gradients would not be averaged across processes and every process would train its own. Apply "
            "`fully_shard` to the PEFT model itself after its layers (`fully_shard(peft_model)`), as accelerate's "
            "FSDP2 does."
        )

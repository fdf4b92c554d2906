"""The learned per-layer mixing of the causal and bidirectional prompt caches."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class BituneKVMixer(nn.Module):
    """
    Two trainable scalars per decoder layer, one for keys and one for values.

    The mixing coefficient of a scalar `w` is `alpha = |w| / (|w| + s)`: `alpha` weighs the bidirectional cache and
    `1 - alpha` the causal one. The scalars are kept in float32 whatever the model's dtype, also through
    `model.to(torch.bfloat16)`, since bf16 cannot represent the small steps they take (an update of 1e-5 to 0.01).

    Args:
        num_layers (`int`): Number of decoder layers of the model.
        init (`float`): Initial value of every `w`.
        scale (`float`): The constant `s`.
    """

    def __init__(self, num_layers: int, init: float, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.key_weights = nn.Parameter(torch.full((num_layers,), float(init), dtype=torch.float32))
        self.value_weights = nn.Parameter(torch.full((num_layers,), float(init), dtype=torch.float32))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> BituneKVMixer:
        """
        Keep the scalars float32 through `model.to(dtype)`, `.half()`, `.bfloat16()`: those casts go through here.
        Device moves still apply; a cast to another float dtype moves the float32 values instead, unrounded.
        """

        def keep_float32(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            if tensor.is_floating_point() and applied.is_floating_point() and applied.dtype != torch.float32:
                return tensor.to(device=applied.device, dtype=torch.float32)
            return applied

        return super()._apply(keep_float32, recurse)

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The alphas for keys and values, each of shape (num_layers,), in float32."""
        return self._alpha(self.key_weights), self._alpha(self.value_weights)

    def _alpha(self, weights: torch.Tensor) -> torch.Tensor:
        magnitude = weights.float().abs()
        return magnitude / (magnitude + self.scale)

    def extra_repr(self) -> str:
        return f"num_layers={self.key_weights.numel()}, scale={self.scale}"


def mix_key_values(
    causal: torch.Tensor, bidirectional: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """
    `(1 - alpha) * causal + alpha * bidirectional`, computed in float32 and cast back to the cache dtype.

    Args:
        causal (`torch.Tensor`): keys or values of the causal pass, of shape (batch, kv_heads, seq, head_dim).
        bidirectional (`torch.Tensor`): the same from the bidirectional pass.
        alpha (`torch.Tensor`): a 0-dim float32 coefficient.
    """
    alpha = alpha.to(causal.device)
    mixed = (1 - alpha) * causal.float() + alpha * bidirectional.float()
    return mixed.to(causal.dtype)

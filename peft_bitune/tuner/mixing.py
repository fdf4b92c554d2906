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

    Two settings narrow the mix without new parameters: `mixed_layers` (a config field) mixes only those layers, the
    others keep the causal cache exactly (their alpha is 0); and the `release` (set by a mixing warm-up during
    training, 1 otherwise) scales every alpha, so that a warm-up can start from the causal cache and let the learned
    mix in gradually. Neither is saved as a weight: `mixed_layers` is in the config, the release is a training state.

    Args:
        num_layers (`int`): Number of decoder layers of the model.
        init (`float`): Initial value of every `w`.
        scale (`float`): The constant `s`.
        mixed_layers (`list[int]`, *optional*): The layers that are mixed; all by default.
    """

    def __init__(self, num_layers: int, init: float, scale: float, mixed_layers: list[int] | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.key_weights = nn.Parameter(torch.full((num_layers,), float(init), dtype=torch.float32))
        self.value_weights = nn.Parameter(torch.full((num_layers,), float(init), dtype=torch.float32))
        self.mixed = [True] * num_layers
        if mixed_layers is not None:
            self.mixed = [layer in set(mixed_layers) for layer in range(num_layers)]
        # Non-persistent: rebuilt from the config when the adapter is loaded, never in the checkpoint.
        self.register_buffer("layer_mask", torch.tensor(self.mixed, dtype=torch.float32), persistent=False)
        self.release = 1.0  # a Python number: reading it costs no device synchronisation

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
        """The alphas in use for keys and values, each of shape (num_layers,), in float32: 0 for a layer that is not
        mixed, and scaled by the release during a mixing warm-up."""
        return self._alpha(self.key_weights), self._alpha(self.value_weights)

    def set_release(self, release: float) -> None:
        """How much of the learned mix is applied, from 0 (the causal cache) to 1 (all of it, the default)."""
        if not 0.0 <= release <= 1.0:
            raise ValueError(f"The mixing release must be between 0 and 1, got {release}.")
        self.release = float(release)

    def _alpha(self, weights: torch.Tensor) -> torch.Tensor:
        magnitude = weights.to(torch.promote_types(weights.dtype, torch.float32)).abs()  # float64 stays float64
        alpha = magnitude / (magnitude + self.scale)
        if not all(self.mixed):
            if hasattr(alpha, "full_tensor"):  # read outside the forward under FSDP2: a sharded DTensor
                alpha = alpha.full_tensor()
            alpha = alpha * self.layer_mask.to(alpha.device)
        if self.release != 1.0:
            alpha = alpha * self.release
        return alpha

    def extra_repr(self) -> str:
        mixed = "" if all(self.mixed) else f", mixed_layers={[i for i, m in enumerate(self.mixed) if m]}"
        return f"num_layers={self.key_weights.numel()}, scale={self.scale}{mixed}"


def mix_key_values(
    causal: torch.Tensor, bidirectional: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """
    `(1 - alpha) * causal + alpha * bidirectional`, computed in float32 (float64 caches: in float64) and cast back to
    the cache dtype.

    In training, only the two caches in their own dtype are kept for the backward pass (it recomputes in float32 what
    it needs), not float32 copies of them: in bf16 those copies would double the keys and values held per layer, the
    largest part of what Bitune keeps under activation checkpointing at 7B widths (docs/training.md, Memory). The
    results are those of autograd through the float32 expression, to the bit.

    Args:
        causal (`torch.Tensor`): keys or values of the causal pass, of shape (batch, kv_heads, seq, head_dim).
        bidirectional (`torch.Tensor`): the same from the bidirectional pass.
        alpha (`torch.Tensor`): a 0-dim float32 coefficient.
    """
    return _MixInFloat32.apply(causal, bidirectional, alpha.to(causal.device))


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The dtype the mix computes in: float32 for bf16, fp16 and float32 caches, float64 for float64 ones (a float64
    reference stays float64 throughout)."""
    return torch.promote_types(dtype, torch.float32)


class _MixInFloat32(torch.autograd.Function):
    """The mix with a backward that saves the caches in their own dtype; each gradient is computed as autograd
    computes it through `(1 - alpha) * causal.float() + alpha * bidirectional.float()`, in the same order (in float64
    for float64 caches)."""

    @staticmethod
    def forward(ctx, causal: torch.Tensor, bidirectional: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(causal, bidirectional, alpha)
        wide = at_least_float32(causal.dtype)
        mixed = (1 - alpha) * causal.to(wide) + alpha * bidirectional.to(wide)
        return mixed.to(causal.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        causal, bidirectional, alpha = ctx.saved_tensors
        wide = at_least_float32(causal.dtype)
        grad = grad.to(wide)
        grad_causal = grad_bidirectional = grad_alpha = None
        if ctx.needs_input_grad[0]:
            grad_causal = (grad * (1 - alpha)).to(causal.dtype)
        if ctx.needs_input_grad[1]:
            grad_bidirectional = (grad * alpha).to(bidirectional.dtype)
        if ctx.needs_input_grad[2]:
            # Through `1 - alpha` (negated) and through `alpha`, each reduced to alpha's shape as autograd does.
            through_causal = (grad * causal.to(wide)).sum_to_size(alpha.shape)
            through_bidirectional = (grad * bidirectional.to(wide)).sum_to_size(alpha.shape)
            grad_alpha = (-through_causal + through_bidirectional).to(alpha.dtype)
        return grad_causal, grad_bidirectional, grad_alpha

"""The cache mix: the float32 expression's results to the bit, keeping only the caches' own dtype for backward."""

from __future__ import annotations

import pytest
import torch

from peft_bitune import BituneKVMixer, mix_key_values


def float32_expression(causal, bidirectional, alpha):
    """The mix as plain autograd computes it (what `mix_key_values` was before it kept its inputs in their dtype)."""
    return ((1 - alpha) * causal.float() + alpha * bidirectional.float()).to(causal.dtype)


def inputs(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    causal = torch.randn(3, 2, 37, 16, generator=generator).to(dtype).requires_grad_()
    bidirectional = torch.randn(3, 2, 37, 16, generator=generator).to(dtype).requires_grad_()
    alpha = torch.tensor(0.37, requires_grad=True)
    upstream = torch.randn(3, 2, 37, 16, generator=generator).to(dtype)
    return causal, bidirectional, alpha, upstream


def mixed_and_gradients(mix, dtype):
    causal, bidirectional, alpha, upstream = inputs(dtype)
    mixed = mix(causal, bidirectional, alpha)
    mixed.backward(upstream)
    return mixed.detach(), causal.grad, bidirectional.grad, alpha.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mix_and_its_gradients_equal_the_float32_expression_to_the_bit(dtype):
    got = mixed_and_gradients(mix_key_values, dtype)
    want = mixed_and_gradients(float32_expression, dtype)
    for name, g, w in zip(("mixed", "causal grad", "bidirectional grad", "alpha grad"), got, want):
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), (name, float((g.float() - w.float()).abs().max()))


def saved_for_backward(mix, dtype) -> list[torch.Tensor]:
    causal, bidirectional, alpha, _ = inputs(dtype)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        mix(causal, bidirectional, alpha)
    return saved


def test_backward_keeps_the_bf16_caches_not_float32_copies():
    saved = saved_for_backward(mix_key_values, torch.bfloat16)
    large = [t for t in saved if t.numel() > 1]
    assert [t.dtype for t in large] == [torch.bfloat16, torch.bfloat16]
    # What plain autograd keeps: float32 copies of both caches, twice the bytes.
    before = [t for t in saved_for_backward(float32_expression, torch.bfloat16) if t.numel() > 1]
    assert sum(t.nbytes for t in before) == 2 * sum(t.nbytes for t in large)


def test_frozen_alpha_and_no_grad_work():
    causal, bidirectional, _, upstream = inputs(torch.bfloat16)
    alpha = torch.tensor(0.5)  # `train_mixing=False`
    mix_key_values(causal, bidirectional, alpha).backward(upstream)
    assert causal.grad is not None and bidirectional.grad is not None
    with torch.no_grad():
        assert torch.equal(mix_key_values(causal, bidirectional, alpha),
                           float32_expression(causal, bidirectional, alpha))


def test_float64_caches_mix_in_float64_not_through_float32():
    """A float64 run (the references of benchmarks/bf16_gradients.py) must not round the mix to float32."""
    got = mixed_and_gradients(mix_key_values, torch.float64)
    causal, bidirectional, alpha, upstream = inputs(torch.float64)
    want = (1 - alpha) * causal + alpha * bidirectional  # autograd in float64 (alpha float32 promotes)
    want.backward(upstream)
    for name, g, w in zip(("mixed", "causal grad", "bidirectional grad", "alpha grad"), got,
                          (want.detach(), causal.grad, bidirectional.grad, alpha.grad)):
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=1e-13, atol=0, msg=name)
    through_float32 = mixed_and_gradients(float32_expression, torch.float64)
    assert not torch.equal(through_float32[0], got[0])  # the old path rounds: the check above can fail


def test_float64_mixing_scalars_give_float64_alphas():
    mixer = BituneKVMixer(num_layers=2, init=0.01, scale=0.01)
    mixer.key_weights.data = torch.tensor([1e-3, 0.3], dtype=torch.float64)
    alpha, _ = mixer.coefficients()
    assert alpha.dtype == torch.float64
    assert alpha[0].item() == 1e-3 / (1e-3 + 0.01)

"""
Bitune's bf16 gradients agree with float64, group by group (causal weights, bidirectional weights, mixing scalars):
under bf16 autocast with float32 weights (TRL's `bf16=True`), and with the weights loaded in bf16 against float64 of
the same rounded weights. The batch is right-padded rows of several lengths, as the trainer builds them.

The bound is grounded in bf16's precision: with a relative error e (in norm) of a gradient, its cosine against the
exact one is about 1 - e**2 / 2. The bound allows e = 8 roundings to bf16 (8 * 2**-8). Measured on an AMD EPYC with
AVX512-BF16 (torch 2.13), the lowest cosine was 0.99992 (e of about 3 roundings), the same under
`ONEDNN_MAX_CPU_ISA=AVX2`, `AVX512_CORE` and `ATEN_CPU_CAPABILITY=avx2` or `default`; the matrix products ran
in oneDNN's native bf16 kernel (`brg_matmul:avx512_core_bf16`), its emulated one (`gemm:jit:bf16`) and, under `AVX2`,
torch's own (`ONEDNN_VERBOSE=1`).

On real models Bitune's gradient is much more sensitive to rounding than on this tiny one
(`benchmarks/bf16_gradients.py`); this test guards the operations, not a model's conditioning: it fails, for one, if
the mix of the two caches is rounded to 8-bit floats (cosines 0.998-0.999).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from peft_bitune import BituneConfig
from precision import UNIT_ROUNDOFF
from tiny_models import VOCAB, model_configs

ROUNDINGS = 8
MIN_COSINE = 1 - (ROUNDINGS * UNIT_ROUNDOFF[torch.bfloat16]) ** 2 / 2  # 0.9995
ROWS = [(12, 6), (9, 4), (15, 3), (7, 8)]  # (instruction, answer) lengths


def group(name: str) -> str:
    if "bitune_mixers" in name:
        return "mixing scalars"
    return "bidirectional weights" if "bidirectional" in name else "causal weights"


def padded_batch() -> dict[str, torch.Tensor]:
    """Right-padded rows of random tokens, loss on the answers."""
    generator = torch.Generator().manual_seed(1)
    length = max(p + a for p, a in ROWS)
    input_ids = torch.zeros(len(ROWS), length, dtype=torch.long)
    attention_mask, labels = torch.zeros_like(input_ids), torch.full_like(input_ids, -100)
    for row, (prompt, answer) in enumerate(ROWS):
        tokens = torch.randint(3, VOCAB, (prompt + answer,), generator=generator)
        input_ids[row, : prompt + answer], attention_mask[row, : prompt + answer] = tokens, 1
        labels[row, prompt : prompt + answer] = tokens[prompt:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def bitune_model(arch: str):
    """A Bitune adapter on a tiny random model, LoRA's B drawn (not zero) so that every weight has a gradient."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(model_configs()[arch])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = get_peft_model(base, BituneConfig(adapter_config=lora))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.train()


def group_gradients(model, batch, dtype: torch.dtype, autocast: bool) -> dict[str, torch.Tensor]:
    """One step with the weights in `dtype` (the mixing scalars stay float32, as the library keeps them)."""
    model.to(dtype)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(**batch).loss.backward()
    grouped: dict[str, list[torch.Tensor]] = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grouped.setdefault(group(name), []).append(parameter.grad.double().flatten())
    model.zero_grad(set_to_none=True)
    return {name: torch.cat(parts) for name, parts in grouped.items()}


def assert_groups_agree(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected) == {"causal weights", "bidirectional weights", "mixing scalars"}
    cosines = {name: float(torch.nn.functional.cosine_similarity(actual[name], expected[name], dim=0))
               for name in expected}
    assert min(cosines.values()) >= MIN_COSINE, f"bf16 gradients against float64, cosine by group: {cosines}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bf16_autocast_gradients_agree_with_float64(arch):
    model, batch = bitune_model(arch), padded_batch()
    expected = group_gradients(model, batch, torch.float64, autocast=False)
    assert_groups_agree(group_gradients(model, batch, torch.float32, autocast=True), expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bf16_weights_gradients_agree_with_float64_of_the_same_weights(arch):
    model, batch = bitune_model(arch), padded_batch()
    model.to(torch.bfloat16)  # the rounded model is the model: its own float64 step is the reference
    expected = group_gradients(model, batch, torch.float64, autocast=False)
    assert_groups_agree(group_gradients(model, batch, torch.bfloat16, autocast=True), expected)


def test_the_float64_reference_stays_float64_through_the_mix_and_the_loss():
    """The references above are float64 end to end: the mix and the loss use float32 only for narrower dtypes."""
    model = bitune_model("llama").to(torch.float64)
    loss = model(**padded_batch()).loss
    assert loss.dtype == torch.float64

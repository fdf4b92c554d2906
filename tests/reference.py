"""A straightforward, one-row-at-a-time Bitune reference, written from BITUNE.md and independent of the library's
batching, layout and cache classes: three explicit passes with transformers' own DynamicCache, mixing by hand."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch.nn import functional as F
from transformers import DynamicCache

from peft_bitune import BituneConfig


def make_bitune(base, adapter_config=None, seed: int = 0, **config_kwargs):
    """A Bitune model whose adapters and mixing scalars are all non-trivial (random, non-zero, per-layer different)."""
    torch.manual_seed(seed)
    if adapter_config is None:
        adapter_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, BituneConfig(adapter_config=adapter_config, **config_kwargs))
    with torch.no_grad():
        for mixer in model.base_model.bitune_mixers.values():
            mixer.key_weights.uniform_(0.002, 0.05)
            mixer.value_weights.uniform_(0.002, 0.05)
    return model


def alphas(model) -> tuple[torch.Tensor, torch.Tensor]:
    bitune = model.base_model
    mixer = bitune.bitune_mixers[bitune.active_adapter]
    scale = bitune.peft_config[bitune.active_adapter].mix_scale
    k, v = mixer.key_weights.abs(), mixer.value_weights.abs()
    return k / (k + scale), v / (v + scale)


def reference_prefill(model, prompt: torch.Tensor, second_pass_causal: bool = False) -> DynamicCache:
    """Steps 1-3 for one unpadded prompt (1, P): a DynamicCache holding the mixed keys/values of prompt[:-1]."""
    bitune = model.base_model
    hf = bitune.model
    head = prompt[:, :-1]
    causal = DynamicCache(config=hf.config)
    if head.shape[1] == 0:
        return causal
    bidirectional = DynamicCache(config=hf.config)
    with bitune.weights("bidirectional"):
        hf(input_ids=head, past_key_values=bidirectional, use_cache=True, is_causal=second_pass_causal)
    with bitune.weights("causal"):
        hf(input_ids=head, past_key_values=causal, use_cache=True, is_causal=True)
    key_alpha, value_alpha = alphas(model)
    for i, (c, b) in enumerate(zip(causal.layers, bidirectional.layers)):
        c.keys = ((1 - key_alpha[i]) * c.keys.float() + key_alpha[i] * b.keys.float()).to(c.keys.dtype)
        c.values = ((1 - value_alpha[i]) * c.values.float() + value_alpha[i] * b.values.float()).to(c.values.dtype)
    return causal


def reference_row(model, tokens: torch.Tensor, prompt_length: int, second_pass_causal: bool = False):
    """One row (1D tokens, no padding): logits of x_P..end (A+1, V) and the summed answer cross-entropy."""
    bitune = model.base_model
    row = tokens[None]
    cache = reference_prefill(model, row[:, :prompt_length], second_pass_causal)
    with bitune.weights("causal"):
        logits = bitune.model(input_ids=row[:, prompt_length - 1 :], past_key_values=cache, use_cache=True).logits[0]
    loss_sum = F.cross_entropy(logits[:-1].float(), tokens[prompt_length:], reduction="sum")
    return logits, loss_sum


def reference_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy decoding by re-running the training-style reference on prompt + generated-so-far at every step."""
    tokens = prompt.tolist()
    for _ in range(max_new_tokens):
        row = torch.tensor(tokens)
        cache = reference_prefill(model, row[None][:, : len(prompt)])
        with model.base_model.weights("causal"):
            logits = model.base_model.model(
                input_ids=row[None, len(prompt) - 1 :], past_key_values=cache, use_cache=True
            ).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]

"""A straightforward, one-row-at-a-time Bitune reference, written from the method as the paper describes it
(Kopiczko et al., 2025; multi-turn: appendix A.8) and independent of the library's batching, layout and cache classes:
three explicit passes with transformers' own DynamicCache, mixing by hand."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from torch.nn import functional as F
from transformers import DynamicCache

from peft_bitune import BituneConfig, compat

# The small batch the batched forward is checked on against the per-row reference (tests and benchmarks/gpu_check.py):
# a one-token prompt, short and longer ones, answers of different lengths, so that left or right padding shows.

# The inner methods other than plain LoRA that the docs list, with random (non-trivial) starting weights.
OTHER_INNER_METHODS = [
    pytest.param(LoraConfig(r=4, target_modules="all-linear", use_dora=True, init_lora_weights=False), id="dora"),
    pytest.param(IA3Config(target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                           feedforward_modules=["down_proj"], init_ia3_weights=False), id="ia3"),
]


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


def left_padded(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """1D token rows as a left-padded batch (pad id 0): `input_ids` and `attention_mask`."""
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = row
        attention_mask[i, width - len(row) :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def alphas(model) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha = |w| / (|w| + s) per layer; 0 for the layers `mixed_layers` leaves out; times the mixing warm-up's
    release (1 outside a warm-up)."""
    bitune = model.base_model
    mixer = bitune.bitune_mixers[bitune.active_adapter]
    config = bitune.peft_config[bitune.active_adapter]
    k, v = mixer.key_weights.abs(), mixer.value_weights.abs()
    key_alpha, value_alpha = k / (k + config.mix_scale), v / (v + config.mix_scale)
    if config.mixed_layers is not None:
        kept = torch.zeros_like(key_alpha)
        kept[config.mixed_layers] = 1.0
        key_alpha, value_alpha = key_alpha * kept, value_alpha * kept
    return key_alpha * mixer.release, value_alpha * mixer.release


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
        hf(input_ids=head, **compat.with_cache(hf, bidirectional), use_cache=True, is_causal=second_pass_causal)
    with bitune.weights("causal"):
        hf(input_ids=head, **compat.with_cache(hf, causal), use_cache=True, is_causal=True)
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
        logits = bitune.model(input_ids=row[:, prompt_length - 1 :], **compat.with_cache(bitune.model, cache),
                              use_cache=True).logits[0]
    loss_sum = F.cross_entropy(logits[:-1].float(), tokens[prompt_length:], reduction="sum")
    return logits, loss_sum


def reference_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy decoding by re-running the training-style reference on prompt + generated-so-far at every step."""
    return reference_greedy_steps(model, prompt, max_new_tokens)[0]


def reference_greedy_steps(model, prompt: torch.Tensor, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """`reference_greedy`'s tokens, and the logits (vocab,) each of them was the argmax of."""
    tokens, step_logits = prompt.tolist(), []
    for _ in range(max_new_tokens):
        row = torch.tensor(tokens, device=prompt.device)
        cache = reference_prefill(model, row[None][:, : len(prompt)])
        with model.base_model.weights("causal"):
            logits = model.base_model.model(
                input_ids=row[None, len(prompt) - 1 :],
                **compat.with_cache(model.base_model.model, cache),
                use_cache=True,
            ).logits
        step_logits.append(logits[0, -1])
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :], step_logits


def _cache_from(keys, values) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, i)
    return cache


def _run(model, weight_set, tokens, keys, values, start, is_causal=True, with_head=False):
    """One pass of `tokens` (1, n) at positions start.. over the given per-layer prefix; returns output, new k/v."""
    bitune = model.base_model
    cache = _cache_from(keys, values) if keys else DynamicCache()
    positions = torch.arange(start, start + tokens.shape[1])[None]
    with bitune.weights(weight_set):
        forward = bitune.model if with_head else bitune.model.get_decoder()
        out = forward(input_ids=tokens, position_ids=positions, **compat.with_cache(forward, cache), use_cache=True,
                      is_causal=is_causal)
    new_keys = [layer.keys[..., start:, :] for layer in cache.layers]
    new_values = [layer.values[..., start:, :] for layer in cache.layers]
    return out, new_keys, new_values


def reference_alternating(model, row, turns, trailing):
    """The paper's multi-turn rule (A.8, alternating) for one row: returns the summed answer cross-entropy and logits
    per turn."""
    key_alpha, value_alpha = alphas(model)
    keys, values, position, loss, all_logits = [], [], 0, 0.0, []
    for number, (instruction, answer) in enumerate(turns):
        segment = row[position : position + instruction]
        if instruction > 1:
            head = segment[None, :-1]
            _, kb, vb = _run(model, "bidirectional", head, keys, values, position, is_causal=False)
            _, kc, vc = _run(model, "causal", head, keys, values, position)
            mixed_k = [((1 - key_alpha[i]) * c + key_alpha[i] * b) for i, (c, b) in enumerate(zip(kc, kb))]
            mixed_v = [((1 - value_alpha[i]) * c + value_alpha[i] * b) for i, (c, b) in enumerate(zip(vc, vb))]
            keys = [torch.cat([o, n], -2) for o, n in zip(keys, mixed_k)] if keys else mixed_k
            values = [torch.cat([o, n], -2) for o, n in zip(values, mixed_v)] if values else mixed_v
        last = position + instruction - 1
        end = last + 1 + answer + (trailing if number == len(turns) - 1 else 0)
        out, kc, vc = _run(model, "causal", row[None, last:end], keys, values, last, with_head=True)
        logits = out.logits[0]
        loss = loss + F.cross_entropy(logits[:answer], row[last + 1 : last + 1 + answer], reduction="sum")
        all_logits.append(logits)
        keys = [torch.cat([o, n], -2) for o, n in zip(keys, kc)] if keys else kc
        values = [torch.cat([o, n], -2) for o, n in zip(values, vc)] if values else vc
        position = end
    return loss, all_logits


# ------------------------------------------------------------------------------ a padded batch against the rows
PROMPT_LENGTHS = [1, 3, 7, 9]
ANSWER_LENGTHS = [4, 2, 5, 3]


def padded_batch(padding_side: str, vocab_size: int, seed: int = 1, prompt_lengths=PROMPT_LENGTHS,
                 answer_lengths=ANSWER_LENGTHS):
    """Rows of random tokens with the given prompt/answer lengths, padded on one side; labels mark the answers.
    Returns the rows, the batch and the prompt mask."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, vocab_size, (p + a,), generator=generator)
            for p, a in zip(prompt_lengths, answer_lengths)]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    prompt_mask = torch.zeros_like(input_ids)
    for i, (row, p) in enumerate(zip(rows, prompt_lengths)):
        start = width - len(row) if padding_side == "left" else 0
        input_ids[i, start : start + len(row)] = row
        attention_mask[i, start : start + len(row)] = 1
        labels[i, start + p : start + len(row)] = row[p:]
        prompt_mask[i, start : start + p] = 1
    return rows, dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels), prompt_mask


def reference_batch(model, rows, prompt_lengths):
    """Per-row reference: answer logits of each row and the batch loss (mean over all supervised tokens)."""
    results = [reference_row(model, row, p) for row, p in zip(rows, prompt_lengths)]
    total = sum(len(row) - p for row, p in zip(rows, prompt_lengths))
    loss = sum(loss_sum for _, loss_sum in results) / total
    return [logits for logits, _ in results], loss


def answer_logits(logits, batch, rows, prompt_lengths):
    """The output logits at x_P..end of each row (positions aligned with the input)."""
    out = []
    for i, (row, p) in enumerate(zip(rows, prompt_lengths)):
        start = int(batch["attention_mask"][i].argmax())
        out.append(logits[i, start + p - 1 : start + len(row)])
    return out


def trainable_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}

"""Bitune's prompt passes inside a vLLM step: which rows are fresh prompts, the bidirectional pass, and the attention
that mixes what it wrote into vLLM's paged cache.

`generate` (peft_bitune/tuner/generation.py) reads a prompt of P tokens as: both prompt passes over its first P-1
tokens (the bidirectional weight set over a non-causal mask, the causal weight set over the causal mask), each layer
attending to its own pass's keys/values; the per-layer mix of the two passes' keys/values is the cache; then token P
and every decoded token run causally with the causal weight set over that cache. In a vLLM step:

- the bidirectional pass runs first, over the first P-1 rows of every fresh prompt, through the decoder's own layers,
  with its own attention (`own_attention`) and the bidirectional weight set; each layer records its keys/values;
- the step's ordinary forward runs next with the causal weight set. Its rows 0..P-2 of a fresh prompt *are* the causal
  prompt pass, provided they attend to their own causal keys/values (`own_attention` again) rather than to the cache;
  each layer writes the mix of the two passes into the cache for those rows, and vLLM's attention computes every
  other row (the last prompt token, decoding rows of other requests) over the paged cache, as decoding reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from peft_bitune.constants import BIDIRECTIONAL, CAUSAL, WeightSet
from peft_bitune.tuner.mixing import mix_key_values

from .adapter import LoraPair

Mode = Literal["plain", "bidirectional", "causal"]


@dataclass(frozen=True)
class PromptRows:
    """The first P-1 rows of one fresh prompt: where they start in the step's rows and in the bidirectional pass's."""

    step_start: int
    pass_start: int
    length: int


@dataclass
class StepState:
    """What the adapted layers of one model read during a step: which pass runs, with which weight set, over which
    prompt rows, and the keys/values each layer's bidirectional pass recorded."""

    mode: Mode = "plain"
    prompts: list[PromptRows] = field(default_factory=list)
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def weight_set(self) -> WeightSet:
        return BIDIRECTIONAL if self.mode == "bidirectional" else CAUSAL

    @contextmanager
    def running(self, mode: Mode, prompts: list[PromptRows]) -> Iterator[None]:
        """Run one pass in `mode`; the state is plain again afterwards, also on error."""
        self.mode, self.prompts = mode, prompts
        try:
            yield
        finally:
            self.mode, self.prompts = "plain", []
            if mode == "causal":
                self.recorded.clear()


def fresh_prompts(query_start_loc: list[int], seq_lens: list[int]) -> list[PromptRows]:
    """The requests of a step that are whole fresh prefills (query length equal to sequence length) of at least two
    tokens, i.e. that have prompt tokens to read twice."""
    prompts, pass_start = [], 0
    for request, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[request], query_start_loc[request + 1]
        if end - start == seq_len and seq_len > 1:
            prompts.append(PromptRows(start, pass_start, seq_len - 1))
            pass_start += seq_len - 1
    return prompts


def own_attention(
    attention: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
) -> torch.Tensor:
    """
    Attention of the rows of one prompt over their own keys/values (not vLLM's cache), with the scale, sliding window
    and soft cap of vLLM's `attention` layer. Inputs and output are flat, (rows, heads * head_size).

    Sliding windows follow transformers' masks, which `generate` uses: causal, a query sees the W keys up to itself
    (q - k < W); bidirectional, those within W either side (|q - k| <= W).
    """
    rows = query.shape[0]
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    query = query.view(rows, heads, attention.head_size).transpose(0, 1)
    key = key.view(rows, kv_heads, attention.head_size).transpose(0, 1)
    value = value.view(rows, kv_heads, attention.head_size_v).transpose(0, 1)
    offset = torch.arange(rows, device=query.device)
    distance = offset[:, None] - offset[None, :]  # query position - key position
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    window = attention.sliding_window
    if window is not None:
        allowed &= distance < window if causal else distance.abs() <= window
    key = key.repeat_interleave(heads // kv_heads, dim=0)
    value = value.repeat_interleave(heads // kv_heads, dim=0)
    softcap = getattr(attention.impl, "logits_soft_cap", 0) or 0
    scale = attention.impl.scale
    if softcap:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        output = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)
    else:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
    return output.transpose(0, 1).reshape(rows, heads * attention.head_size_v)


class BituneAttention(nn.Module):
    """
    Stands in for a decoder layer's vLLM `Attention` (kept as `inner`, which owns the paged cache): plain rows go
    through it unchanged; in the bidirectional pass, each prompt attends to its own keys/values, recorded for the mix;
    in the causal pass, each prompt's first P-1 rows attend to their own causal keys/values, and the cache receives
    the mix of the two passes for those rows (`mix_key_values`, peft_bitune's float32 mix) instead of the causal ones.
    """

    def __init__(self, inner: nn.Module, layer: int, state: StepState, alphas: tuple[torch.Tensor, torch.Tensor],
                 bidirectional_mask: bool) -> None:
        super().__init__()
        self.inner = inner
        self.layer = layer
        self.state = state
        self.alphas = alphas  # (key alpha, value alpha) of this layer, 0-dim float32; set when the adapter loads
        self.bidirectional_mask = bidirectional_mask

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        state = self.state
        if state.mode == "plain":
            return self.inner(query, key, value, **kwargs)
        if state.mode == "bidirectional":
            state.recorded[self.layer] = (key, value)
            output = query.new_empty(query.shape[0], self.inner.num_heads * self.inner.head_size_v)
            for rows in state.prompts:
                span = slice(rows.pass_start, rows.pass_start + rows.length)
                output[span] = own_attention(self.inner, query[span], key[span], value[span],
                                             causal=not self.bidirectional_mask)
            return output
        bidirectional_keys, bidirectional_values = state.recorded.pop(self.layer)
        mixed_keys, mixed_values = key.clone(), value.clone()
        key_alpha, value_alpha = self.alphas
        own = []
        for rows in state.prompts:
            span = slice(rows.step_start, rows.step_start + rows.length)
            recorded = slice(rows.pass_start, rows.pass_start + rows.length)
            mixed_keys[span] = mix_key_values(key[span], bidirectional_keys[recorded], key_alpha)
            mixed_values[span] = mix_key_values(value[span], bidirectional_values[recorded], value_alpha)
            own.append((span, own_attention(self.inner, query[span], key[span], value[span], causal=True)))
        output = self.inner(query, mixed_keys, mixed_values, **kwargs)
        for span, rows_output in own:
            output[span] = rows_output
        return output


class LoraHook:
    """
    A forward hook on one vLLM linear layer that adds the active weight set's LoRA delta to its output, as PEFT's LoRA
    layer adds it: `result + (x @ A.T) @ B.T * scaling`, in the LoRA weights' dtype, cast back. A fused vLLM layer
    (`qkv_proj`, `gate_up_proj`) holds several transformers modules: each adds to its own slice of the output.
    """

    def __init__(self, state: StepState, slices: list[tuple[int, int, dict[WeightSet, LoraPair]]]) -> None:
        self.state = state
        self.slices = slices

    def __call__(self, module: nn.Module, args: tuple, output):
        result = output[0] if isinstance(output, tuple) else output
        x = args[0]
        weight_set = self.state.weight_set
        for start, end, pairs in self.slices:
            pair = pairs[weight_set]
            delta = F.linear(F.linear(x.to(pair.a.dtype), pair.a), pair.b) * pair.scaling
            result[..., start:end] = (result[..., start:end] + delta).to(result.dtype)
        return output

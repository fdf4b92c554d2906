"""
Which kernel PyTorch's scaled-dot-product attention runs, call by call, and for which of Bitune's passes.

`F.scaled_dot_product_attention` picks a backend per call (flash, memory-efficient, cuDNN, the CPU's flash kernel,
or the math fallback, which materialises the whole score matrix) from the inputs: dtype, head size, whether there is
a mask, whether it is causal. A dispatch mode sees the fused operator each call turns into; the math fallback has no
operator of its own but is the only one that calls `aten._safe_softmax`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = torch.ops.aten
BACKENDS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "_safe_softmax": "math",
}
MATH = "math"


@dataclass(frozen=True)
class AttentionCall:
    backend: str
    query_length: int
    key_length: int


class SdpaRecorder(TorchDispatchMode):
    """Records one `AttentionCall` per forward attention call made while it is active (backward kernels are not
    recorded: they follow the forward's choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        backend = BACKENDS.get(func._overloadpacket.__name__)
        if backend == MATH:  # the scores (..., query, key)
            self.calls.append(AttentionCall(backend, args[0].shape[-2], args[0].shape[-1]))
        elif backend is not None:  # query (batch, heads, query, dim), key (batch, kv_heads, key, dim)
            self.calls.append(AttentionCall(backend, args[0].shape[-2], args[1].shape[-2]))
        return func(*args, **(kwargs or {}))


def recorded_calls(function: Callable[[], object]) -> list[AttentionCall]:
    with SdpaRecorder() as recorder:
        function()
    return recorder.calls


def summary(calls: list[AttentionCall]) -> dict:
    """Calls per backend, the shapes seen, and whether any fell back to the math kernel."""
    return {
        "backends": dict(Counter(call.backend for call in calls)),
        "calls": len(calls),
        "query_key_lengths": sorted({(call.query_length, call.key_length) for call in calls}),
        "math_fallback": any(call.backend == MATH for call in calls),
    }


def bitune_training_passes(calls: list[AttentionCall], num_layers: int) -> dict[str, dict]:
    """
    Split the calls of one single-turn Bitune training forward into its passes: the bidirectional prompt pass, then
    the causal one (each `n` calls: `num_layers`, or one fewer where the pass ends once the last layer has written
    its keys/values), then the answer pass (`num_layers` calls).
    """
    prompt_calls = len(calls) - num_layers
    if prompt_calls < 0 or prompt_calls % 2:
        raise ValueError(f"{len(calls)} attention calls do not split into two prompt passes and an answer pass of "
                         f"{num_layers} layers.")
    n = prompt_calls // 2
    return {"bidirectional_prompt": summary(calls[:n]), "causal_prompt": summary(calls[n : 2 * n]),
            "answer": summary(calls[2 * n :])}


def bitune_generation_passes(calls: list[AttentionCall], num_layers: int, new_tokens: int) -> dict[str, dict]:
    """Split the calls of a Bitune `generate` of `new_tokens`: both prompt passes, then one causal step per new token
    (the first over the last prompt token, each later one over the token before); the later steps are decoding."""
    decoding = num_layers * (new_tokens - 1)
    passes = bitune_training_passes(calls[: len(calls) - decoding], num_layers)
    return {"bidirectional_prompt": passes["bidirectional_prompt"], "causal_prompt": passes["causal_prompt"],
            "decoding": summary(calls[len(calls) - decoding :])}

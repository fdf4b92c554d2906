"""
What a training step's prompt passes leave for the answer pass, and the mix the answer pass computes from it where it
reads it (`PromptMix`, read by `caches.PassCacheLayer`): nothing of the mix is held across layers.

Under activation checkpointing every pass keeps each decoder layer's input anyway (a checkpointed layer is recomputed
from it); what else a step keeps for the prompt passes is the boundary between their graphs and the answer pass's.
Autograd runs the answer pass's backward through every layer before the prompt passes' backward starts (their nodes
are older), so the gradient at that boundary is held for every layer until the prompt passes' backward reaches it.
Two boundaries give the same results, and the smaller one is taken for each model (`recompute_prompt_keys_values`):

- the keys and values of both passes (2 passes x (keys + values) x P x the key/value width a layer): each prompt pass
  records them (`HeldKeyValues`), and they, then their gradient, are held;
- each decoder layer's input (2 passes x P x the hidden size a layer): the prompt passes record nothing;
  `capturing_layer_calls` keeps what each decoder layer was called with (references to tensors the pass holds
  anyway), and the answer pass's layer l recomputes the two passes' keys and values of layer l from those calls
  (`LayerCall`: the layer run again up to its cache update, over the prompt, for each pass, in the forward and in
  the checkpointed backward: 1.17 to 1.24 times a step's time on a CPU, `benchmarks/prompt_boundary.py`); only the
  gradient of those inputs is held. Smaller where a token's keys and values outweigh its hidden state: multi-head
  models such as Gemma-7B, Llama-2-7B and Phi-2.

Without checkpointing the recorded keys and values are what each prompt pass's attention keeps for its own backward
anyway, so they are the boundary whatever the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .. import compat
from ..utils.base_model import key_value_width
from .caches import PassCacheLayer
from .mixing import mix_key_values
from .prompt_pass_end import PromptPassComplete


@dataclass(frozen=True, eq=False)
class LayerCall:
    """What one decoder layer was called with in a prompt pass, and the weight set that pass ran with."""

    layer: nn.Module
    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    weights: Callable[[], AbstractContextManager]

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this call wrote to its cache, computed again: the layer's own forward, under the pass's
        weights, ended at its attention's cache update. The layer's `forward` is called directly, without its
        `__call__`: no hooks (the layer runs inside a forward that already gathered it, under FSDP) and no
        checkpoint of its own (the reading layer's checkpoint covers this)."""
        capture = PassCacheLayer(record=True, stop_after_record=True)
        cache = Cache(layers=[capture] * (self.index + 1))  # the attention asks for its own layer index
        kwargs = {name: (cache if isinstance(value, Cache) else value) for name, value in self.kwargs.items()}
        with self.weights(), compat.checkpointing_paused(self.layer):
            try:
                type(self.layer).forward(self.layer, *self.args, **kwargs)
            except PromptPassComplete:
                return capture.recorded_keys, capture.recorded_values
        raise RuntimeError(
            f"{type(self.layer).__name__} did not write its keys/values through the cache's `update` method, which "
            "Bitune needs to read a prompt pass's keys/values."
        )


@contextmanager
def capturing_layer_calls(
    layers: Sequence[nn.Module], weights: Callable[[nn.Module], AbstractContextManager]
) -> Iterator[list[LayerCall]]:
    """
    Keep what each of `layers` (the decoder layers, in order) is called with during the block; yields the list they
    fill, one `LayerCall` a layer. `weights(layer)` makes the context that routes `layer` to the pass's weight set.
    (The pass runs to its end: it only runs under checkpointing, where a pass may not end early, `prompt_pass_end.py`.)
    """
    calls: list[LayerCall | None] = [None] * len(layers)

    def keep(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[index] = LayerCall(module, index, args, dict(kwargs), lambda: weights(module))

        return hook

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, call in enumerate(calls) if call is None]
    if missing:
        raise RuntimeError(
            f"The prompt pass did not call decoder layers {missing}; Bitune reads each layer's keys/values from its "
            "input."
        )


@dataclass(frozen=True, eq=False)
class HeldKeyValues:
    """The keys and values one prompt pass recorded at one layer."""

    keys: torch.Tensor
    values: torch.Tensor

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


def recompute_prompt_keys_values(text_config: Any) -> bool:
    """Whether the prompt passes of a checkpointed training step should leave their layer inputs rather than their
    keys and values (see the module's docstring): where 2 x the hidden size is under 4 x the key/value width."""
    return 2 * text_config.hidden_size < 4 * key_value_width(text_config)


@dataclass(frozen=True, eq=False)
class PromptMix:
    """
    One decoder layer's mix of the two prompt passes' keys and values, computed where the answer pass reads it:
    `mix_key_values` of the keys (values) the causal and the bidirectional pass wrote at this layer, to the bit. A
    layer the mixer leaves out (`BituneConfig.mixed_layers`) reads the causal pass's keys and values as they are.
    Under checkpointing, the reading layer computes it again in its backward instead of holding it.
    """

    causal: LayerCall | HeldKeyValues
    bidirectional: LayerCall | HeldKeyValues
    key_alpha: torch.Tensor
    value_alpha: torch.Tensor
    mixed: bool
    length: int

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        causal_keys, causal_values = self.causal.key_values()
        if not self.mixed:
            return causal_keys, causal_values
        bidirectional_keys, bidirectional_values = self.bidirectional.key_values()
        return (mix_key_values(causal_keys, bidirectional_keys, self.key_alpha),
                mix_key_values(causal_values, bidirectional_values, self.value_alpha))

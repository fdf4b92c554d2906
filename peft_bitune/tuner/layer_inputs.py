"""
What a training step's prompt passes leave for the answer pass, and the mix the answer pass computes from it where it
reads it (`PromptMix`, read by `caches.PassCacheLayer`): nothing of the mix is held across layers.

Without activation checkpointing each prompt pass records its keys and values (`HeldKeyValues`): its attention keeps
them for its own backward anyway.

Under checkpointing every pass keeps each decoder layer's input anyway (a checkpointed layer is recomputed from it),
and nothing else of a prompt pass needs to be held. Autograd, though, runs the answer pass's backward through every
layer before it starts the backward of a pass whose graph was built before it, so whatever joins a prompt pass's graph
to the answer pass's (its keys and values, or their gradient) would be held for every layer at once. So the prompt
passes build no graph of their decoder layers (`capturing_layer_calls`: each layer runs without autograd, and what it
was called with is kept, `LayerCall`), and each one is read layer by layer (`PromptPassChain`): the answer pass's
layer l computes the pass's keys and values of layer l again from the layer's input (the layer's own forward, under
the pass's weights, ended at its cache update), as one autograd node per pass and layer. The nodes of a pass are
chained through the layer inputs they carry, and each node's backward runs its layer's backward (the whole layer,
recomputed from its input) as soon as the answer pass's backward has reached that layer. So a step holds, beyond
LoRA's, the second prompt pass's layer inputs, and one layer's gradient at a time. It costs recomputing the layers up
to their cache update in the forward (and in the answer layer's checkpointed recomputation): 1.02 to 1.05 times the
step time of recording the keys/values on SmolLM2's shape, 1.11 made multi-head, on a CPU
(`benchmarks/prompt_boundary.py`).

The design relies on the order in which autograd runs a backward: of the nodes that are ready, the engine runs the
one created last first (highest sequence number; one ready queue per device). A node created inside the answer
pass's layer l, after that layer's input and before its output, therefore runs its backward after the first node of
layer l's output (where FSDP2's pre-backward hook gathers the layer's parameters) and before the node that takes the
gradient to layer l's input (where FSDP2's post-backward hook reduces the gradients and frees the parameters). So
every node of layer l, of either pass, is created inside the answer pass's layer l, also the ones that only carry a
gradient through a layer the mixer leaves out (`PromptPassChain.pass_on`): created later, inside a layer above, such
a node would run its backward outside its own layer's gathering, on freed parameters. It also takes the layer's
parameters as inputs there, while they are gathered, so that the gradients reach the tensors FSDP2 reduces.

The step draws the random numbers the step without checkpointing draws, in the same order: each prompt pass runs
its layers once (ending where that step's pass ends, `capturing_layer_calls`), and every later run of a layer (a
node's forward or backward) draws from the state its first run drew from (`RandomState`) and leaves the generators
as they were, as a checkpointed layer's recomputation does; autocast is restored the same way, device and CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states
from transformers.cache_utils import Cache

from .. import compat
from .caches import PassCacheLayer
from .mixing import mix_key_values
from .prompt_pass_end import PromptPassComplete, may_end_early, modules_left_early


@dataclass(frozen=True)
class RandomState:
    """The random number generators' state when a prompt-pass layer ran, so that running it again draws the same
    dropout masks: the CPU's and that of the devices of its input, recorded and restored by `torch.utils.checkpoint`'s
    own `get_device_states`/`set_device_states`, as it does for a checkpointed layer."""

    cpu: torch.Tensor
    device_type: str
    devices: list[int]
    device_states: list[torch.Tensor]

    @classmethod
    def of(cls, hidden_states: torch.Tensor) -> RandomState:
        return cls(torch.get_rng_state(), hidden_states.device.type, *get_device_states(hidden_states))

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Within the block, draw from this state; the generators are left as they were after it."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.device_states, device_type=self.device_type)
            yield


@dataclass(frozen=True, eq=False)
class LayerCall:
    """What one decoder layer was called with in a prompt pass, the weight set that pass ran with, the random state
    it drew from and the autocast state it ran under (`compat.autocast_state`, device and CPU)."""

    layer: nn.Module
    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    weights: Callable[[], AbstractContextManager]
    random_state: RandomState
    autocast: Any

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["hidden_states"]

    def run(self, hidden_states: torch.Tensor, to_end: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """
        The call again, on `hidden_states` (the call's own, or a copy to differentiate): the layer's own forward,
        under the pass's weights, random state and autocast, ended at its attention's cache update unless `to_end`.
        Returns the keys and values it wrote to its cache, and its output (`None` if ended early). The layer's
        `forward` is called directly, without its `__call__`: no hooks (the layer runs inside a forward or backward of
        the answer pass's same layer, which already gathered it under FSDP) and no checkpoint of its own.
        """
        capture = PassCacheLayer(record=True, stop_after_record=not to_end)
        kwargs = _with_cache(self.kwargs, capture, self.index)
        args = self.args
        if args:
            args = (hidden_states, *args[1:])
        else:
            kwargs["hidden_states"] = hidden_states
        output = None
        with (self.weights(), compat.checkpointing_paused(self.layer), self.random_state.restored(),
              compat.autocast_restored(self.autocast)):
            try:
                output = type(self.layer).forward(self.layer, *args, **kwargs)
            except PromptPassComplete:
                pass
        if capture.recorded_keys is None:
            raise RuntimeError(
                f"{type(self.layer).__name__} did not write its keys/values through the cache's `update` method, "
                "which Bitune needs to read a prompt pass's keys/values."
            )
        if isinstance(output, tuple):
            output = output[0]
        return capture.recorded_keys, capture.recorded_values, output


@contextmanager
def capturing_layer_calls(
    layers: Sequence[nn.Module], weights: Callable[[nn.Module], AbstractContextManager], decoder: nn.Module
) -> Iterator[list[LayerCall]]:
    """
    Run the decoder layers (`layers` of `decoder`, in order) of the pass in the block without autograd and without
    checkpointing, keeping what each is called with; yields the list they fill, one `LayerCall` a layer.
    `weights(layer)` makes the context that routes `layer` to the pass's weight set. What comes before the first layer
    (the embeddings) keeps its graph: the first layer's input carries it to the chain's first node.

    The pass draws its random numbers as a pass without checkpointing does, so that the step's stream goes on as
    there: where such a pass ends at its last layer's keys/values (`prompt_pass_end.py`: nothing hooks the forwards of
    `decoder` it would leave), this one ends there too (its last layer's cache raises `PromptPassComplete` after its
    update, which the pass catches); otherwise it runs to the end. No checkpoint is around its layers, so leaving them
    early leaves nothing behind.
    """
    calls: list[LayerCall | None] = [None] * len(layers)
    grad_enabled = torch.is_grad_enabled()
    ends_early = may_end_early(modules_left_early(decoder, layers), checkpointing=False)
    last = len(layers) - 1

    def keep(index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden_states = args[0] if args else kwargs["hidden_states"]
            calls[index] = LayerCall(module, index, args, dict(kwargs), lambda: weights(module),
                                     RandomState.of(hidden_states), compat.autocast_state(hidden_states.device.type))
            torch.set_grad_enabled(False)
            if index == last and ends_early:
                return args, _with_cache(kwargs, PassCacheLayer(record=True, stop_after_record=True), index)
            return None

        return hook

    def restore(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        torch.set_grad_enabled(grad_enabled)

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(restore) for layer in layers]
    try:
        with contextlib.ExitStack() as paused:
            for layer in layers:
                paused.enter_context(compat.checkpointing_paused(layer))
            yield calls
    finally:
        torch.set_grad_enabled(grad_enabled)
        for handle in handles:
            handle.remove()
    missing = [i for i, call in enumerate(calls) if call is None]
    if missing:
        raise RuntimeError(
            f"The prompt pass did not call decoder layers {missing}; Bitune reads each layer's keys/values from its "
            "input."
        )


def _with_cache(kwargs: dict[str, Any], layer: PassCacheLayer, index: int) -> dict[str, Any]:
    """A decoder layer's keyword arguments with its cache replaced by one whose layer `index` is `layer` (the
    attention asks the cache for its own layer index)."""
    cache = Cache(layers=[layer] * (index + 1))
    return {name: (cache if isinstance(value, Cache) else value) for name, value in kwargs.items()}


class PromptPassChain:
    """
    One prompt pass, read layer by layer by the answer pass (`key_values(l)` from the answer pass's layer l), with
    its backward run layer by layer inside the answer pass's (see the module's docstring).

    Each layer read adds a node (`_ChainedPromptLayer`) that takes the layer's input, as carried by the node of the
    layer below, and gives the layer's keys and values and the next layer's input. A layer that is not read (one the
    mixer leaves out) gets a node that only carries the next layer's input (`pass_on(l)`), from the answer pass's
    same layer, so that its backward too runs inside that layer's.
    """

    def __init__(self, calls: Sequence[LayerCall]) -> None:
        self.calls = list(calls)
        # What stands for each layer's input in the answer pass's graph: the first layer's is the pass's own (it
        # carries the embeddings' graph); each node sets the next one's. Only the forward sets them: an answer
        # layer's checkpointed recomputation reads them again, and its nodes are never run backward.
        self._carried: list[torch.Tensor | None] = [self.calls[0].hidden_states] + [None] * (len(self.calls) - 1)

    def key_values(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        for below in range(index):  # a layer below that did not read the cache (none does on the supported families)
            self.pass_on(below)
        keys, values = self._node(index, reads=True)
        return keys, values

    def pass_on(self, index: int) -> None:
        """Give layer `index` the node that carries the next layer's input, unless it has one (or is the last)."""
        if index + 1 < len(self.calls) and self._carried[index + 1] is None:
            self._node(index, reads=False)

    def _node(self, index: int, reads: bool) -> tuple[torch.Tensor, ...]:
        call = self.calls[index]
        next_input = self.calls[index + 1].hidden_states if index + 1 < len(self.calls) else None
        params = [param for param in call.layer.parameters() if param.requires_grad]
        outputs = _ChainedPromptLayer.apply(call, reads, next_input, self._carried[index], *params)
        if next_input is not None and self._carried[index + 1] is None:
            self._carried[index + 1] = outputs[-1]
        return outputs[:2] if reads else ()


class _ChainedPromptLayer(torch.autograd.Function):
    """One prompt pass's decoder layer as one autograd node: forward, its keys and values (if `reads`) computed
    again from its input without autograd, and the next layer's input as the pass computed it; backward, the layer
    run again from its input with autograd, differentiated for the gradients of whichever of those were used. An
    output nothing used gets no gradient, not zeros, so the parameters only it depends on get none, as without
    checkpointing."""

    @staticmethod
    def forward(ctx, call: LayerCall, reads: bool, next_input: torch.Tensor | None, hidden_states: torch.Tensor,
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call, ctx.reads, ctx.passes_on, ctx.params = call, reads, next_input is not None, params
        ctx.set_materialize_grads(False)
        outputs = call.run(hidden_states, to_end=False)[:2] if reads else ()
        if next_input is not None:
            outputs += (next_input.detach(),)
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        key_grad, value_grad = grads[:2] if ctx.reads else (None, None)
        next_grad = grads[-1] if ctx.passes_on else None
        if key_grad is None and value_grad is None and next_grad is None:
            return (None,) * (4 + len(ctx.params))
        hidden_states = ctx.call.hidden_states.detach().requires_grad_()
        with torch.enable_grad():
            # The layer reads a view, not the leaf itself: a multi-grad hook put on the layer's input (module
            # trackers, `FlopCounterMode`) cannot be evaluated for a leaf inside `autograd.grad`.
            keys, values, output = ctx.call.run(hidden_states.view_as(hidden_states), to_end=next_grad is not None)
        used = [(tensor, grad) for tensor, grad in ((keys, key_grad), (values, value_grad), (output, next_grad))
                if grad is not None]
        computed = torch.autograd.grad([tensor for tensor, _ in used], (hidden_states, *ctx.params),
                                       [grad for _, grad in used], allow_unused=True)
        return (None, None, None, *computed)


@dataclass(frozen=True, eq=False)
class ChainedRead:
    """A prompt pass's keys and values of one layer, read through its chain."""

    chain: PromptPassChain
    index: int

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chain.key_values(self.index)

    def pass_on(self) -> None:
        """Not read here: carry the pass's gradient through this layer, for a layer above that reads it."""
        self.chain.pass_on(self.index)


@dataclass(frozen=True, eq=False)
class HeldKeyValues:
    """The keys and values one prompt pass recorded at one layer."""

    keys: torch.Tensor
    values: torch.Tensor

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def pass_on(self) -> None:
        """Nothing to carry: the pass's own graph carries its gradient."""


@dataclass(frozen=True, eq=False)
class PromptMix:
    """
    One decoder layer's mix of the two prompt passes' keys and values, computed where the answer pass reads it:
    `mix_key_values` of the keys (values) the causal and the bidirectional pass wrote at this layer, to the bit. A
    layer the mixer leaves out (`BituneConfig.mixed_layers`) reads the causal pass's keys and values as they are.
    Under checkpointing, the reading layer computes it again in its backward instead of holding it.
    """

    causal: ChainedRead | HeldKeyValues
    bidirectional: ChainedRead | HeldKeyValues
    key_alpha: torch.Tensor
    value_alpha: torch.Tensor
    mixed: bool
    length: int

    def key_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        causal_keys, causal_values = self.causal.key_values()
        if not self.mixed:
            self.bidirectional.pass_on()
            return causal_keys, causal_values
        bidirectional_keys, bidirectional_values = self.bidirectional.key_values()
        return (mix_key_values(causal_keys, bidirectional_keys, self.key_alpha),
                mix_key_values(causal_values, bidirectional_values, self.value_alpha))

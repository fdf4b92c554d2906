"""
Ending a prompt pass as soon as its last layer has written its keys/values: the whole mechanism, in one place.

A prompt pass feeds nothing but the keys/values its layers write into the cache, so the last layer's attention output
and MLP, and the final norm, would be computed for nothing. A forward cannot be left midway except by an exception:
the recording cache's last layer raises `PromptPassComplete` right after it has recorded (`caches.PassCacheLayer`,
which gets `stop_after_record` from `BitunePasses.stop_early`), and `BitunePasses.prompt_pass` ends the pass there
through `ending_at_complete_record`. The same cache layer ends a decoder layer that `layer_inputs.LayerCall` runs
again up to its keys/values, which catches it itself. Nothing else in the package raises or catches it.

What it saves is the last layer's share of each prompt pass, about 1/L of it for L layers. Measured by
`benchmarks/prompt_pass_end.py` with one CPU thread (the CPU time of `prefill` and of a training step's forward and
backward, interleaved, with and without the stop): on the shape of SmolLM2-135M (30 layers) 1.5% of the prefill and
2% of a training step at batch 8 and 1, prompt 128, answer 32; on the 4-layer `small` benchmark shape 18% of the
prefill and 7% of a training step at batch 8.

Leaving the decoder by an exception skips whatever was to run after the forwards it leaves, so the stop is allowed
(`may_end_early`) only when nothing runs there. No checkpointed layer is left: a checkpointed layer's recomputation
state would be left to the garbage collector, so under gradient checkpointing the pass runs its last layer without
its checkpoint (`BitunePasses._recorded_key_values`; a training step's single turns run every prompt-pass layer
without autograd and without checkpoint, `layer_inputs.capturing_layer_calls`), so that it draws the random numbers
of the pass without checkpointing; and it does not stop when something hooks into those forwards:
accelerate (offloading, device maps), FSDP, DeepSpeed ZeRO-3 or the user's own hooks. Which modules those are is
computed once per model (`modules_left_early`); reading their hooks needs private attributes of torch and accelerate,
read by `compat.forwards_are_hooked`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from .. import compat


class PromptPassComplete(Exception):
    """Raised by the last layer of a recording pass cache once it holds its keys/values; the pass is complete."""


@contextmanager
def ending_at_complete_record() -> Iterator[None]:
    """Run a prompt pass that may end early: `PromptPassComplete` ends the block quietly."""
    try:
        yield
    except PromptPassComplete:
        pass


def modules_left_early(decoder: nn.Module, decoder_layers: Sequence[nn.Module]) -> tuple[nn.Module, ...]:
    """The decoder's modules that a pass ended at the last layer's keys/values leaves early or skips: all but those
    inside the input embeddings and the earlier decoder layers, which finish before it ends (a checkpointed model's
    embeddings carry transformers' hook that makes their output require gradients)."""
    finished_modules = [*decoder_layers[:-1]]
    try:
        finished_modules.append(decoder.get_input_embeddings())
    except (AttributeError, NotImplementedError):  # a decoder whose embeddings transformers cannot name
        pass
    finished = {id(module) for finished_module in finished_modules for module in finished_module.modules()}
    return tuple(module for module in decoder.modules() if id(module) not in finished)


def may_end_early(left_early: Sequence[nn.Module], checkpointing: bool) -> bool:
    """Whether a prompt pass may end at its last layer's keys/values: not where it would leave a layer under gradient
    `checkpointing`, and only if nothing runs around the forwards of the modules it would leave (`left_early`, see
    `modules_left_early`). Only those modules are checked: a walk of the whole model costs milliseconds on deep
    models."""
    return not checkpointing and not compat.forwards_are_hooked(left_early)

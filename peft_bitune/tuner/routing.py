"""Which weight set the base model's layers run with, pass by pass, also when gradient checkpointing recomputes them.

The inner PEFT method holds both weight sets of a Bitune adapter as two adapters on every tuner layer. A pass runs
with one of them by routing the layers to it: setting their active adapter, without touching `requires_grad`, so that
both weight sets always train (`compat.route_layers`). Gradient checkpointing recomputes a layer during backward,
after its pass has ended, so the recomputation is routed to the weights of the pass that first ran it.

The modules all this touches on every pass are found once per model (`ModuleIndex`): walking the whole module tree
several times per step costs more than the routing itself on deep models.

The routing is the model's own state, shared by every thread, so a model runs one call at a time
(`one_call_at_a_time`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .. import compat
from ..utils.base_model import decoder_of, num_layers
from .prompt_pass_end import may_end_early, modules_left_early
from .sharding import LayerPath

# One lock per tuner (kept out of the tuner itself, which `copy.deepcopy` must be able to copy).
_CALL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def one_call_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """A method of the tuner that routes its layers (`forward`, `prefill`, `generate`) waits for any other thread's
    call to end: each pass switches the layers' weight set, which would switch it under the other thread's pass too
    (PEFT's LoRA switches nothing on a call, so there several threads may share a model). A thread's own nested calls
    (`generate` calling `forward`) go through."""

    @functools.wraps(method)
    def locked(tuner: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _CALL_LOCKS.setdefault(tuner, threading.RLock()):
            return method(tuner, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class ModuleIndex:
    """The modules of the base model that Bitune touches on every pass."""

    tuner_layers: tuple[BaseTunerLayer, ...]
    # The tuner layers inside each decoder layer, by the decoder layer's id: a decoder layer that recomputes a prompt
    # pass's keys/values routes only its own (`layer_inputs.py`), not the whole model's, many times a step.
    tuner_layers_within: dict[int, tuple[BaseTunerLayer, ...]]
    checkpoint_layers: tuple[GradientCheckpointingLayer, ...]
    # The decoder's modules that a prompt pass ended at the last layer's keys/values leaves (see `prompt_pass_end.py`).
    left_early: tuple[nn.Module, ...]
    # Where each decoder layer sits in the model, in layer order: FSDP units and wrappers are found along these.
    decoder_layer_paths: tuple[LayerPath, ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModuleIndex:
        modules = list(model.modules())
        decoder = decoder_of(model)
        decoder_layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
        layer_names = {id(m): name for name, m in model.named_modules()}
        return cls(
            tuple(m for m in modules if isinstance(m, BaseTunerLayer)),
            {id(layer): tuple(m for m in layer.modules() if isinstance(m, BaseTunerLayer))
             for layer in decoder_layers},
            tuple(m for m in modules if isinstance(m, GradientCheckpointingLayer)),
            modules_left_early(decoder, decoder_layers),
            tuple(LayerPath.of(model, layer_names[id(layer)]) for layer in decoder_layers),
        )


class LayerRouter:
    """
    Routes the tuner layers of `model` to one inner adapter (a weight set) at a time.

    Args:
        model (`nn.Module`): the base model, with the inner PEFT method's layers.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._index: ModuleIndex | None = None

    @property
    def index(self) -> ModuleIndex:
        """The modules every pass touches, found on first use after `forget`."""
        if self._index is None:
            self._index = ModuleIndex.of(self.model)
        return self._index

    def forget(self) -> None:
        """Find the modules again on next use: adapters were added or deleted."""
        self._index = None

    def route_to(self, inner_name: str) -> None:
        """Route every tuner layer to the inner adapter `inner_name`, until routed elsewhere."""
        compat.route_layers(self.index.tuner_layers, [inner_name])

    @contextmanager
    def routed_to(self, inner_name: str, within: nn.Module | None = None) -> Iterator[None]:
        """
        Route every tuner layer (or only those of the decoder layer `within`) to `inner_name` within the block; each
        layer's routing is restored on exit.

        A whole pass routed casts its weights for autocast afresh (`torch.clear_autocast_cache`): autocast otherwise
        reuses one low-precision copy of a weight for every pass of the forward, and the passes' gradients of that
        weight would be summed in low precision before they reach it. Each pass's gradient reaches the weight on its
        own, as when gradient checkpointing recomputes each layer under an autocast of its own.
        """
        if within is None:
            torch.clear_autocast_cache()
        layers = self.index.tuner_layers if within is None else self.index.tuner_layers_within[id(within)]
        previous = [compat.routed_adapters(layer) for layer in layers]
        try:
            compat.route_layers(layers, [inner_name])
            yield
        finally:
            for layer, active in zip(layers, previous):
                compat.route_layers([layer], active)

    def checkpointing_layers(self) -> list[GradientCheckpointingLayer]:
        """The layers that will checkpoint in this forward (checkpointing enabled, training mode)."""
        return [m for m in self.index.checkpoint_layers if m.gradient_checkpointing and m.training]

    def prompt_passes_may_stop_early(self) -> bool:
        """Whether a prompt pass may end at its last layer's keys/values in this forward (see `prompt_pass_end.py`).
        Under checkpointing, a pass that ends there runs its last decoder layer without its checkpoint, which needs
        each cache layer's decoder layer (`decoder_layer_paths`)."""
        paths = self.index.decoder_layer_paths
        leaves_a_checkpoint = bool(self.checkpointing_layers()) and len(paths) != num_layers(self.model)
        return may_end_early(self.index.left_early, checkpointing=leaves_a_checkpoint)

    @contextmanager
    def checkpointing_keeps_caches(self) -> Iterator[None]:
        """
        Make gradient checkpointing work across the three passes.

        transformers drops caches in checkpointed layers; ours are safe to keep because they are idempotent (prompt
        passes overwrite their record, the answer pass stores nothing). A layer is recomputed during backward, after
        its pass has ended, so the recomputation is told to run under the weights of the pass that first ran it.
        Reentrant checkpointing silently loses the key/value projections' gradients, so it is refused.
        """
        checkpointing = self.checkpointing_layers()
        if not checkpointing:
            yield
            return
        if any(compat.uses_reentrant_checkpointing(layer) for layer in checkpointing):
            raise ValueError(
                "Bitune needs non-reentrant gradient checkpointing (reentrant checkpointing drops the gradients "
                "of the key/value projections that flow through the mixed cache). Enable it with "
                f"{compat.checkpointing_hint()}. (PEFT's `prepare_model_for_kbit_training` turns on reentrant "
                "checkpointing unless given `gradient_checkpointing_kwargs={'use_reentrant': False}`.)"
            )
        with compat.checkpointed_layers_keep_caches(checkpointing, self._recompute_with_same_weights):
            yield

    def _recompute_with_same_weights(self, checkpoint_func: Callable[..., Any]) -> Callable[..., Any]:
        def checkpoint_in_pass(function: Any, *args: Any, **kwargs: Any) -> Any:
            routed = compat.routed_adapters(self.index.tuner_layers[0])[0]
            if "context_fn" in kwargs:
                raise ValueError(
                    "Bitune sets the checkpoint `context_fn` itself; remove it from the checkpoint kwargs."
                )
            return checkpoint_func(
                function, *args, context_fn=lambda: (nullcontext(), _RoutedEachTime(self, routed)), **kwargs
            )

        return checkpoint_in_pass


class _RoutedEachTime:
    """The routing to `inner_name` as a context that can be entered again: torch enters a checkpoint's recomputation
    context once per recomputation, and a second backward through the same graph (`retain_graph=True`) recomputes
    again."""

    def __init__(self, router: LayerRouter, inner_name: str) -> None:
        self.router, self.inner_name = router, inner_name
        self._entered: list[AbstractContextManager] = []

    def __enter__(self) -> None:
        context = self.router.routed_to(self.inner_name)
        context.__enter__()
        self._entered.append(context)

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._entered.pop().__exit__(*exc_info)

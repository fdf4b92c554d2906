"""Interleaved timing and peak-memory measurement, so that a ratio holds on a noisy, shared machine.

Timing: the workloads run in rounds, in an order that alternates between rounds (A B, B A, A B, ...), so that both
see the same spells of machine load. The reported ratio is that of each workload's fastest run (see `Ratio`); the
median and spread of the per-round ratios are reported alongside as a measure of the noise.

Memory: the peak of the bytes allocated *during* one call above what was allocated when it started (the model's
weights and the inputs are not counted, only activations, gradients and temporaries). On CUDA this comes from the
caching allocator's statistics; on CPU, where torch keeps no such statistics, from a dispatch mode that follows
every tensor storage created during the call until it is freed.
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """
    Reads the time after the device's queued work is done.

    `"wall"` is elapsed time. `"cpu"` is the CPU time of this process (all its threads): on a CPU shared with other
    jobs it counts the work done, not the time spent waiting for a core, so it stays steady when the machine's load
    changes. With one torch thread it is the wall time the same work takes on an idle core. `"cuda_events"` records a
    CUDA event in the stream instead of waiting for the device at each reading: the GPU's own time between two
    readings, with no host synchronisation in the middle of the timed work.
    """

    KINDS = ("wall", "cpu", "cuda_events")

    def __init__(self, kind: str, device: torch.device) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"`kind` must be one of {self.KINDS}, got {kind!r}.")
        if kind == "cpu" and device.type != "cpu":
            raise ValueError("The `cpu` clock measures CPU work; time a GPU with the `wall` clock.")
        if kind == "cuda_events" and device.type != "cuda":
            raise ValueError("The `cuda_events` clock times a CUDA device; time a CPU with `wall` or `cpu`.")
        self.kind = kind
        self.device = device
        self._read = time.perf_counter if kind == "wall" else time.process_time

    def now(self) -> float | torch.cuda.Event:
        """A reading; only `elapsed` between two readings is meaningful."""
        if self.kind == "cuda_events":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        synchronize(self.device)
        return self._read()

    def elapsed(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        """Seconds between two readings."""
        if self.kind == "cuda_events":
            end.synchronize()
            return start.elapsed_time(end) / 1000
        return end - start

    def timed(self, function: Callable[[], object]) -> float:
        """Seconds one call of `function` takes on this clock."""
        start = self.now()
        function()
        return self.elapsed(start, self.now())


@dataclass(frozen=True)
class RoundPolicy:
    """How many interleaved rounds to run: at least `min_rounds`, then more until `budget_s` or `max_rounds`."""

    min_rounds: int = 3
    max_rounds: int = 9
    budget_s: float = 20.0

    def more(self, rounds_done: int, elapsed_s: float) -> bool:
        if rounds_done < self.min_rounds:
            return True
        return rounds_done < self.max_rounds and elapsed_s < self.budget_s


def interleaved_rounds(workloads: dict[str, Callable[[], dict[str, float]]], policy: RoundPolicy) -> list[dict]:
    """
    Run every workload once per round, in an order that rotates each round, after one untimed warm-up of each.

    Each workload returns a dict of named measurements (seconds); the result is one merged dict per round, keyed
    `"<workload>/<measurement>"`.
    """
    for workload in workloads.values():
        workload()
    names = list(workloads)
    rounds: list[dict] = []
    start = time.perf_counter()
    while policy.more(len(rounds), time.perf_counter() - start):
        shift = len(rounds) % len(names)
        order = names[shift:] + names[:shift]
        if len(rounds) % 2 == 1:
            order = order[::-1]
        measurements = {}
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for name in order:
                for key, value in workloads[name]().items():
                    measurements[f"{name}/{key}"] = value
        finally:
            if gc_was_enabled:
                gc.enable()
        rounds.append(measurements)
    return rounds


@dataclass(frozen=True)
class Ratio:
    """
    Bitune's time over LoRA's, from interleaved rounds.

    `value` is the ratio of the two fastest runs. On a shared machine, interference only ever slows a run down (other
    jobs taking the core, the caches or the memory bandwidth; on a virtual machine, even the CPU-time clock counts the
    time the host gave to someone else), so each workload's fastest run is its best estimate and their ratio is the
    steadiest figure. The per-round ratios are kept too: their median and spread show how noisy the machine was.
    """

    value: float
    round_median: float
    round_low: float
    round_high: float
    numerator_s: float
    denominator_s: float
    rounds: int
    numerator_median_s: float
    denominator_median_s: float

    @classmethod
    def from_rounds(cls, rounds: list[dict], numerator: str, denominator: str) -> Ratio:
        ratios = [r[numerator] / r[denominator] for r in rounds]
        fastest_numerator = min(r[numerator] for r in rounds)
        fastest_denominator = min(r[denominator] for r in rounds)
        return cls(
            value=fastest_numerator / fastest_denominator,
            round_median=statistics.median(ratios),
            round_low=min(ratios),
            round_high=max(ratios),
            numerator_s=fastest_numerator,
            denominator_s=fastest_denominator,
            rounds=len(rounds),
            numerator_median_s=statistics.median(r[numerator] for r in rounds),
            denominator_median_s=statistics.median(r[denominator] for r in rounds),
        )

    def as_dict(self) -> dict[str, float]:
        return dict(ratio=self.value, round_ratio_median=self.round_median, round_ratio_min=self.round_low,
                    round_ratio_max=self.round_high, numerator_s=self.numerator_s,
                    denominator_s=self.denominator_s, rounds=self.rounds,
                    numerator_median_s=self.numerator_median_s, denominator_median_s=self.denominator_median_s,
                    median_ratio=self.numerator_median_s / self.denominator_median_s)


class StorageTracker(TorchDispatchMode):
    """
    Live bytes of the tensor storages created while the mode is active, and their peak.

    Storages that existed before (weights, inputs, a gradient accumulated in place) are never counted: a storage is
    counted when it first appears as an op's output without having been an input, and uncounted when it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counted: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._preexisting: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._finalizers: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs, _ = tree_flatten((args, kwargs or {}))
        for tensor in inputs:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._counted:
                    self._preexisting[storage] = True
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage in self._counted or storage in self._preexisting:
            return
        size = storage.nbytes()
        self._counted[storage] = size
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._finalizers.append(weakref.ref(storage, lambda _, size=size: self._release(size)))

    def _release(self, size: int) -> None:
        self.live_bytes -= size


class SkipMatmulArithmetic(TorchDispatchMode):
    """
    Matrix products (`mm`, `addmm`, `bmm`) and the CPU's fused attention (forward and backward) return zeros of their
    real outputs' shapes, strides and dtypes instead of computing (taken from the operators' meta kernels, run with
    every dispatch mode off so that no tracker counts them); a product written into a given tensor (`out=`) zeroes
    that tensor, and one accumulated in place (`addmm_`) leaves it as it was.

    Memory does not depend on what the numbers are: every tensor is allocated at its real size all the same, while a
    training step of a multi-billion-parameter shape takes seconds instead of many minutes on a CPU. Only for
    measuring allocations (the values it gives are meaningless). Enter it inside `peak_bytes_during`, so that the
    tracker sees the zeros it allocates.
    """

    SKIPPED = ("mm", "addmm", "addmm_", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ not in self.SKIPPED:
            return func(*args, **(kwargs or {}))
        if func._overloadname == "out":  # writes into a tensor it is given (TRL's fused head): nothing to allocate
            return kwargs["out"].zero_()
        if func._overloadpacket.__name__ == "addmm_":  # accumulates into its first argument: left as it is
            return args[0]
        if func._overloadname != "default":
            return func(*args, **(kwargs or {}))
        device = next(a.device for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor))
        with _disable_current_modes():
            on_meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs or {}))
            out = func(*on_meta[0], **on_meta[1])
        return tree_map_only(torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                         device=device).zero_(), out)

    @classmethod
    def around(cls, function: Callable[[], object]) -> object:
        with cls():
            return function()


def peak_bytes_during(function: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated during one call of `function`, above what was allocated when it started."""
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        function()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        raise ValueError(f"Peak memory is measured on 'cpu' and 'cuda' only, not on {device.type!r}.")
    with StorageTracker() as tracker:
        function()
    return tracker.peak_bytes


def linear_flops(function: Callable[[], object]) -> int:
    """
    FLOPs of the plain matrix products (`mm`, `addmm`: linear layers, LoRA, the LM head) in one call, backward
    included.

    Attention is left out on purpose: its cost depends on the kernel (a causal kernel skips half the scores, a masked
    one does not), which a FLOP count cannot see.
    """
    with FlopCounterMode(display=False) as counter:
        function()
    counts = counter.get_flop_counts().get("Global", {})
    aten = torch.ops.aten
    return sum(count for op, count in counts.items() if op in (aten.mm, aten.addmm))

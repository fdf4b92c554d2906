"""The model worker of `bitune-serve`: one thread that runs the model's work, and answers waiting requests in batches.

One thread, so that no two batches ever share the model, a cache or torch's random state, and so that the event loop
of the HTTP server never waits for the model. Work is queued in arrival order. A plain job (a callable) runs alone. A
batchable job (a request) runs together with the batchable jobs queued behind it that its `Batcher` lets join: the
job at the head of the queue always starts the next batch, so a job that cannot join a batch waits at most one batch
per job ahead of it. Results are `concurrent.futures.Future`s (awaitable from asyncio with `asyncio.wrap_future`).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

_STOP = object()


class Batcher(Protocol):
    """What answers batchable jobs: which may share a batch, and how a batch is answered."""

    def can_join(self, batch: list[Any], item: Any) -> bool:
        """Whether `item` may be answered in one batch with `batch` (never empty)."""

    def run_batch(self, items: list[Any], deliver: Callable[[int, Any], None]) -> list[Any]:
        """One result per item, in order; an exception instance for an item that failed (the others stand).
        `deliver(index, result)` may hand an item's result over earlier, as soon as it is known."""


@dataclass
class _Job:
    future: Future
    function: Callable[[], Any] | None = None  # a plain job ...
    batcher: Batcher | None = None  # ... or a batchable one
    item: Any = None


# A queue and a condition of our own, not an `asyncio.Queue` drained by a one-thread executor: requests are also
# queued without an event loop (`ChatEngine.run`'s callers, tests, benchmarks), and a batch takes every waiting job
# that may join the head, which neither an `asyncio.Queue` nor an executor's private queue lets the worker see.
class ModelWorker:
    """A daemon thread that runs queued jobs: plain callables one at a time, batchable items in batches. A job whose
    future was cancelled before it started (e.g. with its asyncio waiter) is skipped. `batch_sizes` counts the batches
    by their number of items (plain jobs are not counted)."""

    def __init__(self, name: str = "bitune-model-worker") -> None:
        self._queue: deque = deque()
        self._ready = threading.Condition()
        self.batch_sizes: Counter[int] = Counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue `function(*args, **kwargs)`, to run alone; returns the future of its result."""
        return self._put(_Job(Future(), functools.partial(function, *args, **kwargs)))

    def submit_item(self, batcher: Batcher, item: Any) -> Future:
        """Queue `item`, to be answered by `batcher.run_batch` with whatever may join it; returns its future."""
        return self._put(_Job(Future(), batcher=batcher, item=item))

    def batch_size_counts(self) -> dict[str, int]:
        """`batch_sizes` as JSON writes it (`/health`, the throughput benchmark): sizes as strings, smallest first."""
        return {str(size): count for size, count in sorted(self.batch_sizes.items())}

    def pending(self) -> int:
        """How many jobs wait in the queue (not counting those running)."""
        with self._ready:
            return len(self._queue)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread once the jobs queued before this call have run."""
        with self._ready:
            self._queue.append(_STOP)
            self._ready.notify()
        self._thread.join(timeout)

    def _put(self, job: _Job) -> Future:
        if not self._thread.is_alive():
            raise RuntimeError("The model worker has stopped; no more work can be submitted.")
        with self._ready:
            self._queue.append(job)
            self._ready.notify()
        return job.future

    def _run(self) -> None:
        while (jobs := self._next_jobs()) is not _STOP:
            if jobs and jobs[0].batcher is None:
                self._run_plain(jobs[0])
            elif jobs:
                self._run_batch(jobs)
            jobs = None  # free the jobs' objects (e.g. kept caches) before waiting for the next ones

    def _next_jobs(self) -> list[_Job] | object:
        """The head of the queue, with the batchable jobs behind it that may join it (taken out of the queue)."""
        with self._ready:
            while not self._queue:
                self._ready.wait()
            head = self._queue.popleft()
            if head is _STOP or head.batcher is None:
                return head if head is _STOP else [head]
            batch, items, left = [head], [head.item], deque()
            while self._queue and self._queue[0] is not _STOP:  # nothing queued after `close` joins
                job = self._queue.popleft()
                if job.batcher is head.batcher and head.batcher.can_join(items, job.item):
                    batch.append(job)
                    items.append(job.item)
                else:
                    left.append(job)
            self._queue = left + self._queue
        return [job for job in batch if job.future.set_running_or_notify_cancel()]

    @staticmethod
    def _run_plain(job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            result = job.function()
        except BaseException as error:  # handed to whoever waits for the job; the worker goes on
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _run_batch(self, jobs: list[_Job]) -> None:
        self.batch_sizes[len(jobs)] += 1
        try:
            results = jobs[0].batcher.run_batch([job.item for job in jobs], lambda i, r: _settle(jobs[i].future, r))
        except BaseException as error:  # the whole batch failed: every waiter learns why; the worker goes on
            results = [error] * len(jobs)
        for job, result in zip(jobs, results):
            _settle(job.future, result)


def _settle(future: Future, result: Any) -> None:
    """Set a future's result (or exception), unless it was already delivered."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)

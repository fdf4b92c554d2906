"""The model worker of `bitune-serve`: one thread that runs the model's work, one job at a time, in arrival order.

One thread, so that no two requests ever share the model, a cache or torch's random state, and so that the event loop
of the HTTP server never waits for the model. Jobs are plain callables with a `concurrent.futures.Future` for their
result (the standard library's, awaitable from asyncio through `asyncio.wrap_future`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = object()


class ModelWorker:
    """
    A daemon thread that runs submitted callables one after another.

    A job whose future was cancelled before it started (e.g. its asyncio waiter was cancelled) is skipped.
    """

    def __init__(self, name: str = "bitune-model-worker") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue `function(*args, **kwargs)`; returns the future of its result."""
        if not self._thread.is_alive():
            raise RuntimeError("The model worker has stopped; no more work can be submitted.")
        future: Future = Future()
        self._jobs.put((future, function, args, kwargs))
        return future

    def async_submit(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
        """`submit`, awaitable from the running event loop."""
        return asyncio.wrap_future(self.submit(function, *args, **kwargs))

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread once the jobs queued before this call have run."""
        self._jobs.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            self._run_one(*job)
            job = None  # free the job's objects (e.g. a kept cache) before waiting for the next one

    @staticmethod
    def _run_one(future: Future, function: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = function(*args, **kwargs)
        except BaseException as error:  # handed to whoever waits for the job; the worker goes on
            future.set_exception(error)
        else:
            future.set_result(result)

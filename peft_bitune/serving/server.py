"""Running the app with uvicorn: in the foreground (`bitune-serve`), or on a background thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

STARTUP_TIMEOUT_S = 60.0
# How long an idle keep-alive connection stays open: longer than clients keep theirs (httpx, under the openai client:
# 5 s), so that a client never sends on a connection the server is closing at that moment (a reset, not an answer).
KEEP_ALIVE_S = 75


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (read it back with `sock.getsockname()[1]`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(app: Any, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve `app` on a bound socket until interrupted."""
    uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S)).run(sockets=[sock])


@contextmanager
def serving_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` on a background thread for the duration of the block; yields the base URL (e.g. for tests)."""
    sock = bind(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("The server did not start.")
            time.sleep(0.02)
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_TIMEOUT_S)
        sock.close()

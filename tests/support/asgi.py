"""An ASGI app served by a real uvicorn (httptools) on 127.0.0.1, in a thread of
its own, for the unit tests that talk HTTP or WebSocket to one."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from tests.support.services import free_port

__all__ = ["serving"]


@contextlib.contextmanager
def serving(app: Any, **config: Any) -> Iterator[int]:
    """Serve ``app`` until the block ends; its port. ``config`` goes to
    ``uvicorn.Config`` (a keep-alive timeout, ``lifespan="off"``)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools",
                                           log_level="critical", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)

"""An ASGI app served by a real uvicorn (httptools) on 127.0.0.1, in a thread of
its own, for the unit tests that talk HTTP or WebSocket to one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import uvicorn

from tests.support.services import free_port

__all__ = ["chat_events", "serving"]


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


async def chat_events(pieces: Iterable[str], pace_s: float = 0.0,
                      usage: dict[str, int] | None = None) -> AsyncIterator[str]:
    """A streamed chat completion as an OpenAI-compatible upstream sends it:
    one event a piece (``pace_s`` apart), the finish, the usage if given, [DONE]."""
    def event(choices: list[dict[str, Any]], **more: Any) -> str:
        return "data: " + json.dumps({"id": "x", "choices": choices, **more}) + "\n\n"

    for piece in pieces:
        if pace_s:
            await asyncio.sleep(pace_s)
        yield event([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
    yield event([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    if usage is not None:
        yield event([], usage=usage)
    yield "data: [DONE]\n\n"

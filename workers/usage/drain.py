"""A producer-buffer flush that waits for every buffered changelog write.

Faust commits a source offset right after ``app.producer.flush()``, and
faust-streaming's ``ProducerBuffer.flush`` returns once 0.1 s pass without a
message handed on, not counting the one being handed over: an offset could
be committed while its changelog writes still sat in the buffer, and a
SIGKILL then lost the count (docs/decisions/0002-faust-on-the-cold-path-only.md).

:func:`drain_before_commit` replaces the buffer's ``flush`` with one that
returns once every message put before the flush began has been handed to
aiokafka, whose flush then waits for their acknowledgements. Later writes
belong to events the commit does not cover, so a busy stream cannot keep a
flush from ending. A flush not done within ``timeout_s`` raises: the commit
fails and the events are read again, which the counting rules make harmless.

Written against faust-streaming 0.15.3 (``faust/transport/producer.py``);
pinned by tests/unit/workers/usage/test_faust_patches.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BufferDrain", "drain_before_commit"]

_POLL_S = 0.005


class BufferDrain:
    """Counts what a ProducerBuffer was given and has handed on, and flushes it
    up to what it was given when the flush began."""

    def __init__(self, buffer: Any, timeout_s: float) -> None:
        self.buffer = buffer
        self.timeout_s = timeout_s
        # called as a flush begins, before it counts what it waits for: writes
        # held back until a commit (workers/usage/write_behind.py) join the flush
        self.before: Callable[[], object] | None = None
        self.put_count = 0
        self.handed = 0
        self._put = buffer.put
        self._send = buffer._send_pending

    def put(self, message: Any) -> None:
        self.put_count += 1
        self._put(message)

    async def send_pending(self, message: Any) -> None:
        try:
            await self._send(message)
        finally:
            self.handed += 1

    async def flush(self) -> None:
        """Return once every message put before this call is handed on."""
        if self.before is not None:
            self.before()
        target = self.put_count
        deadline = time.monotonic() + self.timeout_s
        while self.handed < target:
            if self.buffer.state != "running":
                raise RuntimeError(f"cannot flush: the producer buffer is {self.buffer.state}, "
                                   f"{target - self.handed} messages unsent")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"producer buffer not drained within {self.timeout_s} s "
                                   f"({target - self.handed} messages unsent)")
            await asyncio.sleep(_POLL_S)


def drain_before_commit(buffer: Any, timeout_s: float) -> BufferDrain:
    """Make ``buffer`` (a faust ProducerBuffer, before it starts) flush fully."""
    drain = BufferDrain(buffer, timeout_s)
    # instance attributes: Producer.send_soon calls put, _handle_pending reads
    # _send_pending when it starts, Producer.flush and on_stop call flush
    buffer.put = drain.put
    buffer._send_pending = drain.send_pending
    buffer.flush = drain.flush
    return drain

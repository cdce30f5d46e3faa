"""A producer-buffer flush that waits for every buffered changelog write.

Faust commits a source offset (``processing_guarantee="at_least_once"``)
right after ``app.producer.flush()``, which drains Faust's own
ProducerBuffer (where every table write waits as a changelog message) and
then aiokafka's. faust-streaming's ``ProducerBuffer.flush`` returns as soon
as 0.1 s pass without a message handed on, and it does not count the
message being handed to aiokafka at that moment. On a busy host the
accounting app could therefore commit a usage event's offset while the
event's changelog writes still sat in the buffer; a SIGKILL then lost the
count for good (the restarted app neither reads the event again nor finds
the write in the changelog).

:func:`drain_before_commit` replaces the buffer's ``flush`` with one that
returns only once the buffer is empty and nothing is being handed on, so
the aiokafka flush that follows waits for every changelog write's
acknowledgement before the offset is committed. A flush that cannot finish
within ``timeout_s`` raises instead of returning: the commit fails and the
events are read again, which the ledger's request-id table makes harmless.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["BufferDrain", "drain_before_commit"]

_POLL_S = 0.005


class BufferDrain:
    """Counts the messages a ProducerBuffer is handing on, and flushes it fully."""

    def __init__(self, buffer: Any, timeout_s: float) -> None:
        self.buffer = buffer
        self.timeout_s = timeout_s
        self.sending = 0
        self._send = buffer._send_pending

    async def send_pending(self, message: Any) -> None:
        self.sending += 1
        try:
            await self._send(message)
        finally:
            self.sending -= 1

    async def flush(self) -> None:
        """Return once no message is buffered or being handed on."""
        deadline = time.monotonic() + self.timeout_s
        while self.buffer.size or self.sending:
            if self.buffer.state != "running":
                raise RuntimeError(f"cannot flush: the producer buffer is {self.buffer.state}, "
                                   f"{self.buffer.size + self.sending} messages unsent")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"producer buffer not drained within {self.timeout_s} s "
                                   f"({self.buffer.size + self.sending} messages unsent)")
            await asyncio.sleep(_POLL_S)


def drain_before_commit(buffer: Any, timeout_s: float) -> BufferDrain:
    """Make ``buffer`` (a faust ProducerBuffer, before it starts) flush fully."""
    drain = BufferDrain(buffer, timeout_s)
    # instance attributes: _handle_pending reads _send_pending when it starts,
    # Producer.flush and the buffer's own on_stop call flush
    buffer._send_pending = drain.send_pending
    buffer.flush = drain.flush
    return drain

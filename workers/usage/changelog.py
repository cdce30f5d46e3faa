"""The ledger's changelog writes, and a commit only once they are acknowledged:
:class:`WriteBehind` changes the table's store at once and sends each changed
row once a commit; :func:`drain_before_commit` makes the producer buffer's
flush wait for every message put before it (past ``timeout_s`` the commit
fails and the events are read again). Why, and the internals relied on:
docs/decisions/0002-faust-on-the-cold-path-only.md; pinned by
tests/unit/workers/usage/test_faust_patches.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

__all__ = ["WriteBehind", "BufferDrain", "drain_before_commit"]


class WriteBehind(MutableMapping[str, Any]):
    """Rows of a Faust table (``table.data`` is its store), changelogged on
    :meth:`flush`. Each row value carries its partition as ``p``."""

    def __init__(self, table: Any) -> None:
        self.table = table
        # row key -> the partition of its changelog, for the rows changed since
        # the last flush (a deleted row: a tombstone to send)
        self.pending: dict[str, int] = {}

    @property
    def store(self) -> Any:
        return self.table.data

    def __getitem__(self, key: str) -> Any:
        return self.store[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.store[key] = value
        self.pending[key] = value["p"]

    def __delitem__(self, key: str) -> None:
        row = self.store[key]
        del self.store[key]
        self.pending[key] = row["p"]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.store))

    def __len__(self) -> int:
        return len(self.store)

    def flush(self) -> int:
        """Send every changed row (a tombstone for a deleted one) to the
        changelog; how many."""
        pending, self.pending = self.pending, {}
        for key, partition in pending.items():
            row = self.store.get(key)
            if row is None:
                self.table.send_changelog(partition, key, None, value_serializer="raw")
            else:
                self.table.send_changelog(partition, key, row)
        return len(pending)

    def drop(self, partition: int) -> int:
        """Forget the unsent rows of ``partition`` (it went to another member),
        and take them out of the store; how many."""
        gone = [key for key, p in self.pending.items() if p == partition]
        for key in gone:
            del self.pending[key]
            self.store.pop(key, None)
        return len(gone)


_POLL_S = 0.005


class BufferDrain:
    """Counts what a ProducerBuffer was given and has handed on, and flushes it
    up to what it was given when the flush began."""

    def __init__(self, buffer: Any, timeout_s: float) -> None:
        self.buffer = buffer
        self.timeout_s = timeout_s
        # called as a flush begins, before it counts what it waits for: writes
        # held back until a commit (WriteBehind) join the flush
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

"""The request ids of one usage partition's latest events: what a repeat is
checked against.

Postprocess writes a request's UsageRecord again only when it rebuilds the
request from ``conveyor.tokens`` after a crash or a rebalance
(workers/postprocess/layer.py). Both copies land in the same partition (the
topic is keyed by tenant), the second a bounded number of records after the
first: postprocess never commits past the first chunk of a request still
open and forgets one 60 s after its deadline, so what lies between the
copies is that partition's usage traffic in about the request's time limit
plus 60 s, the takeover and the replay (time postprocess is down adds none).

A repeat is recognised among the ids of the ``size`` offsets before it
(:data:`SEEN_WINDOW`, 100,000): the default 300 s limit at up to about 250
usage events a second into one partition. A copy further back (an hour-long
``X-Conveyor-Timeout`` at full rate) is counted again; memory is bounded
instead (about 17 MB a full partition).

The rule looks only at the log, so the window is never stored: after a
restart or a rebalance it is read back from the usage topic
(:func:`ids_before`), and a replay is judged exactly as the first run was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator
from typing import Any, cast

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from topics.follow import follow

__all__ = ["SeenWindow", "SEEN_WINDOW", "ids_before", "request_id_of"]

SEEN_WINDOW = 100_000


class SeenWindow:
    """The request ids at the offsets ``[next_offset - size, next_offset)`` of one
    partition (None where the value was not a UsageRecord)."""

    def __init__(self, size: int, next_offset: int) -> None:
        if size < 1:
            raise ValueError(f"a seen window holds at least one offset, not {size}")
        self.size = size
        self.next_offset = next_offset
        self._ids: deque[str | None] = deque()  # one entry per offset, oldest first
        self._copies: dict[str, int] = {}  # id -> how many of its copies are in _ids

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._copies

    def __len__(self) -> int:
        """How many distinct request ids the window holds."""
        return len(self._copies)

    def add(self, offset: int, request_id: str | None) -> None:
        """The id read at ``offset`` (None: no UsageRecord there); offsets only
        grow, and any skipped between hold nothing."""
        if offset < self.next_offset:
            raise ValueError(f"offset {offset} is behind the window's next, {self.next_offset}")
        gap = offset - self.next_offset
        if gap >= self.size:
            self._ids.clear()
            self._copies.clear()
        else:
            for _ in range(gap):
                self._push(None)
        self._push(request_id)
        self.next_offset = offset + 1

    def _push(self, request_id: str | None) -> None:
        self._ids.append(request_id)
        if request_id is not None:
            self._copies[request_id] = self._copies.get(request_id, 0) + 1
        if len(self._ids) > self.size:
            gone = self._ids.popleft()
            if gone is not None:
                left = self._copies[gone] - 1
                if left:
                    self._copies[gone] = left
                else:
                    del self._copies[gone]


# what ids_before reads is bounded by its count: 100,000 records are about 20 MB
_FETCH_BYTES = 8 * 1024 * 1024


def request_id_of(value: bytes | None, codec: Codec) -> str | None:
    """The request id of a usage value; None when it is not a UsageRecord."""
    try:
        return str(codec.decode(value, "UsageRecord")["request_id"])
    except Exception:  # a poison value holds no request id
        return None


async def ids_before(settings: Settings, topic: str, partition: int, offset: int,
                     count: int, codec: Codec | None = None
                     ) -> list[tuple[int, str | None]]:
    """``(offset, request id or None)`` of the records of ``topic[partition]`` in
    ``[offset - count, offset)`` (from the partition's start when that is
    later), in offset order."""
    start = max(0, offset - count)
    if start >= offset:
        return []
    codec = codec or default_codec()
    follower = follow(settings, topic, partition, start,
                      max_partition_fetch_bytes=_FETCH_BYTES)
    found: list[tuple[int, str | None]] = []
    # a generator, closed here so that its consumer stops now, not when collected
    batches = cast(AsyncGenerator[list[Any], None], follower.batches())
    try:
        async for records in batches:
            for record in records:
                if record.offset >= offset:
                    return found
                found.append((record.offset, request_id_of(record.value, codec)))
            if records[-1].offset + 1 >= offset:
                return found
    finally:
        await batches.aclose()
    return found

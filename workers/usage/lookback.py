"""Reading back the request ids just before an offset of the usage topic.

The accounting app's window of recent request ids (workers/usage/seen.py)
lives in memory only; when a partition's events start again somewhere the
app has not just been (at start, after a rebalance, on a replay), the ids of
the ``count`` records before that offset are read here, from the usage topic
itself, with the one partition reader every Conveyor follower uses
(topics/follow.py: it waits through a broker outage rather than fail).

What it costs is bounded by ``count``: 100,000 records of about 200 bytes are
about 20 MB from the broker and a second or two of decoding; nothing that
grows with the ledger's age is read.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, cast

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from topics.follow import follow

__all__ = ["ids_before", "request_id_of"]

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

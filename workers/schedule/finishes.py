"""Generations' ends, read from ``conveyor.tokens`` (every partition, from its
end when schedule starts): a slot freed is heard within milliseconds, not at
the next heartbeat. Only chunks of requests schedule waits for (``wanted``,
checked on the request ids a record names) are decoded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import ErrorInfo, TokenChunk
from topics.catalog import TOKENS
from topics.follow import Follower, Record, follow
from topics.reader import ended_ids, request_ids

__all__ = ["FinishFollower", "OnFinish"]

log = logging.getLogger(__name__)

_BATCH_WAIT_MS = 20
_BATCH_BYTES = 256 * 1024

# (request id, worker id, when the final chunk was written: the worker's clock,
# ms, the generation's error or None)
OnFinish = Callable[[str, str, int, ErrorInfo | None], None]


class FinishFollower:
    """Follows every partition of ``conveyor.tokens``; calls ``on_finish`` for
    the final chunk of each request ``wanted`` accepts."""

    def __init__(self, settings: Settings, wanted: Callable[[str], bool], on_finish: OnFinish,
                 codec: Codec | None = None, partitions: int | None = None) -> None:
        self.settings = settings
        self.wanted = wanted
        self.on_finish = on_finish
        self.codec = codec or default_codec()
        self.partitions = settings.kafka.pipeline_partitions if partitions is None else partitions
        self.follower: Follower | None = None

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Follow until cancelled (through broker outages: see topics/follow.py);
        ``ready`` is set once every partition is positioned at its end."""
        # one consumer for every partition, its fetch held by the broker until it
        # has _BATCH_BYTES or _BATCH_WAIT_MS passed: one fetch each _BATCH_WAIT_MS,
        # not one per chunk (docs/decisions/0013-the-price-of-the-log.md)
        follower = self.follower = follow(
            self.settings, TOKENS, range(self.partitions), "end", poll_ms=200,
            fetch_max_wait_ms=_BATCH_WAIT_MS, fetch_min_bytes=_BATCH_BYTES)

        async def signal_ready(ready: asyncio.Event) -> None:
            await follower.caught_up.wait()
            ready.set()

        signalling = None if ready is None else asyncio.create_task(signal_ready(ready))
        try:  # a failure surfaces on the layer
            async for batch in follower.events(self.codec, keep=self.wants):
                for record, chunk in batch:
                    self.read(record, chunk)
        finally:
            if signalling is not None:
                signalling.cancel()

    def wants(self, record: Record) -> bool:
        """A record that ends a generation ``wanted`` accepts (only those are
        decoded): by its ended-ids header, or any of its requests' when it has
        none (a prompt cache hit's chunk, written alone)."""
        ids = ended_ids(record)
        return any(self.wanted(rid.decode(errors="replace"))
                   for rid in (request_ids(record) if ids is None else ids))

    def read(self, record: Record, chunk: TokenChunk) -> None:
        """Hand on the end of a wanted generation."""
        ended = chunk["finish_reason"] is not None or chunk["error"] is not None
        rid = chunk["envelope"]["request_id"]
        if ended and self.wanted(rid):
            self.on_finish(rid, chunk["worker_id"], record.timestamp, chunk["error"])

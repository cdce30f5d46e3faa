"""The tasks this scheduler sent to workers that have not finished yet, counted
until their generation's final chunk appears on ``conveyor.tokens``
(:class:`FinishFollower`), or a cancel, a heartbeat or their deadline drops
them (docs/decisions/0005-schedule-holds-the-queue.md)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import ErrorInfo, TokenChunk, WorkerHeartbeat
from topics.catalog import TOKENS
from topics.envelope import PRIORITY_INTERACTIVE, now_ms
from topics.follow import Follower, Record, follow
from topics.reader import ended_ids, request_ids

__all__ = ["Outstanding", "Sent", "FinishFollower", "OnFinish"]

log = logging.getLogger(__name__)


# an entry outlives its request's deadline by this much before it is dropped
# (a worker gives a generation up a minute after its deadline)
_EXPIRE_GRACE_MS = 90_000
_EXPIRE_EVERY_MS = 5000


@dataclass(slots=True)
class Sent:
    request_id: str
    worker_id: str
    pool: str
    priority: int
    sent_ms: int
    give_up_ms: int
    tenant: str = ""


def _count_key(sent: Sent) -> tuple[str, str | None]:
    return (sent.pool, sent.tenant if sent.priority <= PRIORITY_INTERACTIVE else None)


class Outstanding:
    def __init__(self, clock: Callable[[], int] = now_ms) -> None:
        self.clock = clock
        self._reconciled: dict[str, int] = {}  # worker id -> the last beat's time
        self._expired_at = 0
        self._by_id: dict[str, Sent] = {}
        # worker -> its entries in the order they were sent
        self._by_worker: dict[str, dict[str, Sent]] = {}
        # (pool, tenant) -> its interactive tasks; (pool, None) -> the pool's others
        self._counts: Counter[tuple[str, str | None]] = Counter()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def at(self, worker_id: str) -> int:
        """Tasks this scheduler sent to ``worker_id`` that have not finished."""
        return len(self._by_worker.get(worker_id, ()))

    def low_at(self, worker_id: str) -> int:
        """Background and batch tasks this scheduler sent to ``worker_id``, not finished."""
        return sum(s.priority > PRIORITY_INTERACTIVE
                   for s in self._by_worker.get(worker_id, {}).values())

    def low(self, pool: str) -> int:
        """Background and batch tasks of ``pool`` sent and not finished."""
        return self._counts[(pool, None)]

    def interactive(self, pool: str) -> int:
        """Interactive tasks of ``pool`` sent and not finished."""
        return sum(n for (p, tenant), n in self._counts.items()
                   if p == pool and tenant is not None)

    def of_tenant(self, pool: str, tenant: str) -> int:
        """Interactive tasks of ``tenant`` in ``pool`` sent and not finished."""
        return self._counts[(pool, tenant)]

    def add(self, request_id: str, worker_id: str, pool: str, priority: int,
            give_up_ms: int, tenant: str = "") -> None:
        self.forget(request_id)  # sent again (a redelivery): count it once
        sent = Sent(request_id, worker_id, pool, priority, self.clock(), give_up_ms, tenant)
        self._by_id[request_id] = sent
        self._by_worker.setdefault(worker_id, {})[request_id] = sent
        self._counts[_count_key(sent)] += 1

    def forget(self, request_id: str) -> Sent | None:
        """The request finished (or was cancelled): its entry, if there was one."""
        sent = self._by_id.pop(request_id, None)
        if sent is None:
            return None
        mine = self._by_worker.get(sent.worker_id)
        if mine is not None:
            mine.pop(request_id, None)
            if not mine:
                del self._by_worker[sent.worker_id]
        key = _count_key(sent)
        self._counts[key] -= 1
        if not self._counts[key]:
            del self._counts[key]
        return sent

    def reconcile(self, worker_id: str, running: int, capacity: int, beat_ms: int,
                  slack_ms: int) -> list[str]:
        """Drop entries a heartbeat with room proves finished; their request ids."""
        if running >= capacity:
            return []
        mine = self._by_worker.get(worker_id)
        if not mine:
            return []
        old = [s.request_id for s in mine.values() if s.sent_ms <= beat_ms - slack_ms]
        stale = old[:max(0, len(old) - running)]
        for request_id in stale:
            self.forget(request_id)
        return stale

    def reconcile_beats(self, beats: list[WorkerHeartbeat], slack_ms: int) -> None:
        """Let heartbeats not seen before correct the counts (:meth:`reconcile`),
        and every few seconds drop what is long past its deadline (:meth:`expire`)."""
        for beat in beats:
            wid = beat["worker_id"]
            if self._reconciled.get(wid) != beat["ts_ms"]:
                self._reconciled[wid] = beat["ts_ms"]
                self.reconcile(wid, beat["running"], beat["capacity"], beat["ts_ms"], slack_ms)
        now = self.clock()
        if now - self._expired_at >= _EXPIRE_EVERY_MS:
            self._expired_at = now
            self.expire()

    def expire(self) -> list[str]:
        """Drop entries long past their request's deadline; their request ids."""
        horizon = self.clock() - _EXPIRE_GRACE_MS
        stale = [s.request_id for s in self._by_id.values() if s.give_up_ms < horizon]
        for request_id in stale:
            self.forget(request_id)
        return stale


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

"""The live worker table, built from ``conveyor.workers`` heartbeats.

The topic is compacted and keyed by worker id, so reading it from the start
rebuilds the table after a restart: the log is the changelog. A worker is
live while its last heartbeat is younger than ``worker_ttl_s`` and its state
is ``ready``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from conveyor.errors import SchemaError
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import WorkerHeartbeat
from topics.clients import make_consumer
from topics.envelope import now_ms

__all__ = ["WorkerTable", "WorkerView"]

log = logging.getLogger(__name__)


@dataclass
class WorkerView:
    beat: WorkerHeartbeat
    # tasks this scheduler sent since the beat was written (not yet in `queued`)
    sent_since_beat: int = 0
    next_partition: int = 0

    def load(self) -> float:
        b = self.beat
        return (b["running"] + b["queued"] + self.sent_since_beat) / max(1, b["capacity"])


@dataclass
class WorkerTable:
    settings: Settings
    codec: Codec = field(default_factory=default_codec)
    workers: dict[str, WorkerView] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def apply(self, beat: WorkerHeartbeat) -> None:
        old = self.workers.get(beat["worker_id"])
        view = WorkerView(beat, next_partition=old.next_partition if old else 0)
        self.workers[beat["worker_id"]] = view
        self.changed.set()

    def live(self, pool: str) -> list[WorkerView]:
        horizon = now_ms() - int(self.settings.worker_ttl_s * 1000)
        return [
            w
            for w in self.workers.values()
            if w.beat["pool"] == pool
            and w.beat["state"] == "ready"
            and w.beat["ts_ms"] >= horizon
            and w.beat["partitions"]
        ]

    def choose(self, pool: str) -> tuple[WorkerView, int] | None:
        """The least loaded live worker of ``pool`` and one of its partitions."""
        candidates = self.live(pool)
        if not candidates:
            return None
        best = min(candidates, key=lambda w: (w.load(), w.beat["worker_id"]))
        parts = best.beat["partitions"]
        partition = parts[best.next_partition % len(parts)]
        best.next_partition += 1
        best.sent_since_beat += 1
        return best, partition

    async def follow(self, ready: asyncio.Event | None = None) -> None:
        """Read the heartbeat topic from the start, then keep following it."""
        topic = self.settings.topic("workers")
        consumer = make_consumer(self.settings, group=None)
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp]
            if end == 0 and ready is not None:
                ready.set()
            while True:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    for record in records:
                        try:
                            self.apply(self.codec.decode(record.value, "WorkerHeartbeat"))
                        except SchemaError as exc:
                            log.warning("ignoring a bad heartbeat at %d: %s", record.offset, exc)
                if ready is not None and not ready.is_set():
                    if await consumer.position(tp) >= end:
                        ready.set()
        finally:
            await consumer.stop()

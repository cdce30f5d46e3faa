"""The live worker table, built from the compacted ``conveyor.workers``
heartbeats; liveness is measured against the last moment the table could see
the topic, and :meth:`WorkerTable.settling` says when the view is not to be
trusted (docs/decisions/0005-schedule-holds-the-queue.md)."""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import WorkerHeartbeat
from topics.catalog import WORKERS
from topics.envelope import now_ms
from topics.follow import Follower, apply_all, follow

__all__ = ["WorkerTable", "WorkerView", "relative_speeds", "serves", "warm_first"]

log = logging.getLogger(__name__)


@dataclass
class WorkerView:
    beat: WorkerHeartbeat
    # tasks this scheduler sent since the beat was written (not yet in `queued`)
    sent_since_beat: int = 0
    # tasks of this scheduler whose final chunk was written after the beat
    finished_since_beat: int = 0
    # KV tokens the tasks this scheduler sent since the beat may take
    kv_since_beat: int = 0
    next_partition: int = 0

    def busy(self) -> int:
        """The worker's tasks as its last beat and what happened since tell."""
        b = self.beat
        return max(0, b["running"] + b["queued"] + self.sent_since_beat
                   - self.finished_since_beat)


def serves(view: WorkerView, model: str) -> bool:
    """Whether the worker serves ``model`` (a worker that names no models serves
    its pool's)."""
    models = view.beat["models"]
    return not models or model in models


def warm_first(views: list[WorkerView], model: str) -> list[WorkerView]:
    """Those of ``views`` that have ``model`` loaded, when any has; else all. A
    worker that loads lazily says what it has loaded (empty: everything it
    serves), and a request sent to it cold waits for the load
    (workers/infer/engines/model_set.py)."""
    warm = [v for v in views if not v.beat.get("loaded") or model in v.beat["loaded"]]
    return warm or views


def relative_speeds(views: list[WorkerView]) -> dict[str, float]:
    """Each worker's speed against the median of ``views`` (by the time per output
    token its beats report; 1 for a worker not measured yet), within 1/4..4."""
    tpots = {v.beat["worker_id"]: t for v in views if (t := v.beat.get("tpot_ms"))}
    if not tpots:
        return {}
    median = statistics.median(tpots.values())
    return {wid: min(4.0, max(0.25, median / t)) for wid, t in tpots.items()}


@dataclass
class WorkerTable:
    settings: Settings
    codec: Codec = field(default_factory=default_codec)
    workers: dict[str, WorkerView] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    follower: Follower | None = None
    clock: Callable[[], int] = now_ms
    # told of every heartbeat applied (schedule's prefix index reads the blocks)
    on_beat: Callable[[WorkerHeartbeat], None] | None = None

    def seen_until_ms(self) -> int:
        """Up to when the table has seen every heartbeat written: now, or the
        last contact while it cannot reach the heartbeat topic."""
        if self.follower is not None and not self.follower.reachable:
            return min(self.clock(), self.follower.last_contact_ms)
        return self.clock()

    def settling(self) -> bool:
        """The view is not to be trusted: the heartbeat topic out of reach now,
        or contact regained less than ``worker_ttl_s`` ago (workers may not
        have beaten since)."""
        if self.follower is None:
            return False
        return not self.follower.reachable or (
            self.clock() - self.follower.regained_ms < self.settings.schedule.worker_ttl_s * 1000)

    def apply(self, beat: WorkerHeartbeat) -> None:
        old = self.workers.get(beat["worker_id"])
        view = WorkerView(beat, next_partition=old.next_partition if old else 0)
        self.workers[beat["worker_id"]] = view
        if self.on_beat is not None:
            self.on_beat(beat)
        self.changed.set()

    def pools(self) -> set[str]:
        """The pools of the workers seen (live or not)."""
        return {w.beat["pool"] for w in list(self.workers.values())}

    def live(self, pool: str) -> list[WorkerView]:
        horizon = self.seen_until_ms() - int(self.settings.schedule.worker_ttl_s * 1000)
        return [
            w
            for w in self.workers.values()
            if w.beat["pool"] == pool
            and w.beat["state"] == "ready"
            and w.beat["ts_ms"] >= horizon
            and w.beat["partitions"]
        ]

    def interactive(self, pool: str) -> tuple[int, int]:
        """Interactive traffic on ``pool`` as its live workers' last beats tell,
        whoever sent it: (generations running, when the last was taken, ms)."""
        live = self.live(pool)
        return (sum(w.beat["interactive_running"] for w in live),
                max((w.beat["interactive_ms"] for w in live), default=0))

    @staticmethod
    def address(view: WorkerView) -> int:
        """The partition of ``view``'s worker the next task goes to (round robin);
        the task counts on the worker until its next beat."""
        parts = view.beat["partitions"]
        partition = parts[view.next_partition % len(parts)]
        view.next_partition += 1
        view.sent_since_beat += 1
        return partition

    def finished(self, worker_id: str, written_ms: int) -> None:
        """A task of this scheduler ended on ``worker_id`` (its final chunk was
        written at ``written_ms``, the worker's clock, as the beat's ``ts_ms``):
        it no longer counts, unless the last beat was written after it."""
        view = self.workers.get(worker_id)
        if view is not None and written_ms >= view.beat["ts_ms"]:
            view.finished_since_beat += 1

    async def follow(self, ready: asyncio.Event | None = None) -> None:
        """Read the heartbeat topic from the start, then keep following it
        (through Kafka outages: see topics/follow.py). ``ready`` is set once
        the heartbeats written before the start are read."""
        self.follower = follow(self.settings, WORKERS, 0, "beginning")
        await apply_all(self.follower, self.codec, self.apply,
                        None if ready is None else ready.set)

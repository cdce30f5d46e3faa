"""The infer workers as their last heartbeats and breaker states tell, kept by
following both compacted topics: what ``conveyor workers`` prints, one row a
worker (pool, engine, models, load, KV and host cache, measured speed, GPU,
breaker, heartbeat age)."""

from __future__ import annotations

import asyncio
from typing import Any

from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import BreakerState, WorkerHeartbeat
from topics.catalog import BREAKERS, WORKERS
from topics.envelope import now_ms
from topics.follow import apply_all, follow
from workers.schedule.breakers import Breakers
from workers.schedule.breakers import describe as describe_breaker

__all__ = ["Fleet", "describe"]


def describe(beat: WorkerHeartbeat, settings: Settings, now: int,
             breaker: BreakerState | None = None) -> dict[str, Any]:
    """One worker as a row (``conveyor workers --json`` prints them)."""
    age_s = max(0.0, (now - beat["ts_ms"]) / 1000)
    kv = beat.get("kv")
    kv_out: dict[str, Any] | None = None
    if kv is not None:
        queries = kv["prefix_queries"]
        kv_out = {**kv, "prefix_hit_rate": kv["prefix_hits"] / queries if queries else None}
    return {
        "worker_id": beat["worker_id"], "pool": beat["pool"], "engine": beat["engine"],
        "models": beat["models"], "loaded": beat.get("loaded") or beat["models"],
        "state": beat["state"],
        "live": beat["state"] == "ready" and age_s <= settings.schedule.worker_ttl_s,
        "partitions": beat["partitions"], "capacity": beat["capacity"],
        "running": beat["running"], "queued": beat["queued"], "host": beat["host"],
        "gpu_utilization": beat["gpu_utilization"], "gpu_memory_free": beat["gpu_memory_free"],
        "kv": kv_out, "host_cache": beat.get("host_cache"),
        "heartbeat_age_s": round(age_s, 1),
        "prefill_tps": _rounded(beat.get("prefill_tps")),
        "tpot_ms": _rounded(beat.get("tpot_ms")),
        "breaker": describe_breaker(breaker, now),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


class Fleet:
    """Every infer worker's last heartbeat and breaker state, kept by
    :meth:`follow` (for ever, through broker outages); :meth:`read` waits until
    what was written before the start is in, :meth:`rows` describes the workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.beats: dict[str, WorkerHeartbeat] = {}
        # every worker's breaker as the schedulers last wrote it (what /healthz reports)
        self.breakers = Breakers.of(settings)
        self._beating, self._breaking = follow(settings, WORKERS), follow(settings, BREAKERS)

    async def follow(self) -> None:
        codec = default_codec()
        await asyncio.gather(
            apply_all(self._beating, codec,
                      lambda beat: self.beats.__setitem__(beat["worker_id"], beat)),
            apply_all(self._breaking, codec, self.breakers.apply))

    async def read(self, within_s: float) -> None:
        """Wait for both topics' state as of the start; TimeoutError past ``within_s``."""
        await asyncio.wait_for(asyncio.gather(self._beating.caught_up.wait(),
                                              self._breaking.caught_up.wait()), within_s)

    @property
    def read_yet(self) -> bool:
        return self._beating.caught_up.is_set() and self._breaking.caught_up.is_set()

    def rows(self, pool: str | None = None) -> list[dict[str, Any]]:
        """Every worker (of ``pool``), by id."""
        now = now_ms()
        return [describe(b, self.settings, now, self.breakers.states.get(wid))
                for wid, b in sorted(self.beats.items()) if pool is None or b["pool"] == pool]

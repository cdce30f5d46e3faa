"""The heartbeat of an infer worker on ``conveyor.workers`` (compacted, key = worker id)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import asdict
from typing import Literal, NamedTuple, cast

from conveyor.settings import Settings
from schemas.records import HostCache, KvCache, WorkerHeartbeat
from topics.catalog import WORKERS
from topics.envelope import now_ms
from workers.infer.engines.base import (
    Engine,
    HoldsPrompts,
    HostCacheStats,
    KeepsHostCache,
    KvState,
)
from workers.infer.gpu import GpuProbe
from workers.outputs import Output, Sender
from workers.prefix import HeldBlocks

__all__ = ["Heartbeat", "Snapshot", "host_cache_of", "reported_blocks"]


def reported_blocks(held: HeldBlocks, engine: Engine, kv: KvState | None,
                    settings: Settings) -> list[int] | None:
    """The prompt blocks a worker reports: those of the prompts it ran, no more
    than its caches can hold where the engine says how much that is (the
    tokens its contexts and host memory hold, or else its KV cache's blocks)."""
    if settings.prefix.report_blocks <= 0:
        return None
    room = engine.cache_tokens() if isinstance(engine, HoldsPrompts) else None
    if room is None and kv is not None:
        room = kv.total_blocks * kv.block_tokens
    if room is not None and settings.prefix.block_tokens > 0:
        held.trim(room // settings.prefix.block_tokens)
    return held.blocks()


def host_cache_of(engine: Engine) -> HostCacheStats | None:
    """The engine's host-memory cache counts, where it keeps one."""
    return engine.host_cache_stats() if isinstance(engine, KeepsHostCache) else None


class Snapshot(NamedTuple):
    """What a worker holds at a heartbeat."""

    partitions: list[int]
    running: int
    queued: int
    # interactive (priority 0) generations running, and when the last one was
    # taken (ms, 0: never): schedule members see interactive traffic they did
    # not send themselves (workers/schedule/admission.py)
    interactive_running: int = 0
    interactive_ms: int = 0
    # the engine's KV cache, where it keeps one the worker can see
    kv: KvState | None = None
    # its measured speed (workers/infer/speed.py); None until measured
    prefill_tps: float | None = None
    tpot_ms: float | None = None
    # of the models it serves, those loaded now (None: all of them)
    loaded: list[str] | None = None
    # the prompt blocks its KV cache holds, most recent last (workers/prefix.py);
    # None: it does not say
    prefix_blocks: list[int] | None = None
    # the llama.cpp engines' host-memory cache (None: the engine keeps none)
    host_cache: HostCacheStats | None = None


class Heartbeat:
    def __init__(self, settings: Settings, sender: Sender, worker_id: str, pool: str,
                 engine: str, models: list[str], capacity: int,
                 snapshot: Callable[[], Snapshot]) -> None:
        self.settings = settings
        self.sender = sender
        self.worker_id = worker_id
        self.pool = pool
        self.engine = engine
        self.models = models
        self.capacity = capacity
        self.snapshot = snapshot
        self.state: Literal["ready", "draining", "stopped"] = "ready"
        self.host = socket.gethostname()
        self.gpu = GpuProbe()  # the GPUs this worker sees (workers/infer/gpu.py)

    async def beat(self) -> None:
        now = self.snapshot()
        gpu_util, gpu_free = self.gpu.read()
        record = WorkerHeartbeat(
            worker_id=self.worker_id, pool=self.pool, engine=self.engine, models=self.models,
            loaded=list(now.loaded or ()), state=self.state,
            partitions=sorted(now.partitions), capacity=self.capacity,
            running=now.running, queued=now.queued, ts_ms=now_ms(), host=self.host,
            gpu_utilization=gpu_util, gpu_memory_free=gpu_free,
            interactive_running=now.interactive_running, interactive_ms=now.interactive_ms,
            prefill_tps=now.prefill_tps, tpot_ms=now.tpot_ms, prefix_blocks=now.prefix_blocks,
            # the engine's dataclasses have the records' fields
            kv=None if now.kv is None else cast(KvCache, asdict(now.kv)),
            host_cache=None if now.host_cache is None else cast(HostCache, asdict(now.host_cache)),
        )
        await self.sender.deliver(Output(WORKERS.at(self.settings.kafka), "WorkerHeartbeat",
                                         record, key=self.worker_id))

"""The heartbeat of an infer worker on ``conveyor.workers`` (compacted, key =
worker id): what the worker runs, what its engine says of itself (read at each
beat), and:

* :class:`Speed`: the worker's prefill rate and time per output token, each
  an exponentially weighted moving average (weight ``ALPHA``) of generations
  long enough to say something; schedule weighs capacity by it.
* :class:`GpuProbe`: utilisation and free memory of the GPUs
  ``CUDA_VISIBLE_DEVICES`` names (unset: every GPU; NVML indices, ``GPU-``
  or ``MIG-`` UUIDs or unique prefixes; empty, ``-1`` or ``NoDevFiles``:
  none; the list ends at the first entry that names no device), read from
  NVML: the mean utilisation and the sum of free memory. A host without
  NVML reports ``(None, None)`` and is asked again at most once a minute.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from conveyor.settings import Settings
from schemas.records import KvCache, WorkerHeartbeat
from topics.catalog import WORKERS
from topics.envelope import now_ms
from workers.infer.engines.base import Engine
from workers.outputs import Output, Sender
from workers.prefix import HeldBlocks

__all__ = ["Heartbeat", "Snapshot", "reported_blocks", "GpuProbe",
           "visible_entries", "Speed", "ALPHA"]

log = logging.getLogger(__name__)


def reported_blocks(held: HeldBlocks, engine: Engine, kv: KvCache | None,
                    settings: Settings) -> list[int] | None:
    """The prompt blocks a worker reports: those of the prompts it ran, no more
    than its caches can hold where the engine says how much that is (the
    tokens its contexts and host memory hold, or else its KV cache's blocks)."""
    if settings.prefix.report_blocks <= 0:
        return None
    room = engine.cache_tokens()
    if room is None and kv is not None:
        room = kv["total_blocks"] * kv["block_tokens"]
    if room is not None and settings.prefix.block_tokens > 0:
        held.trim(room // settings.prefix.block_tokens)
    return held.blocks()


class Snapshot(NamedTuple):
    """What a worker runs at a heartbeat."""

    partitions: list[int]
    running: int
    # interactive (priority 0) generations running, and when the last one was
    # taken (ms, 0: never): schedule members see interactive traffic they did
    # not send themselves (workers/schedule/held.py)
    interactive_running: int = 0
    interactive_ms: int = 0


class Heartbeat:
    """Beats for a worker running ``engine``: ``snapshot`` says what it runs,
    ``held`` the prompt blocks it ran (workers/prefix.py), ``speed`` how fast."""

    def __init__(self, settings: Settings, sender: Sender, worker_id: str, pool: str,
                 engine: Engine, models: list[str], snapshot: Callable[[], Snapshot],
                 held: HeldBlocks, speed: Speed) -> None:
        self.settings = settings
        self.sender = sender
        self.worker_id = worker_id
        self.pool = pool
        self.engine = engine
        self.models = models
        self.snapshot = snapshot
        self.held = held
        self.speed = speed
        self.state: Literal["ready", "draining", "stopped"] = "ready"
        self.host = socket.gethostname()
        self.gpu = GpuProbe()  # the GPUs this worker sees

    async def beat(self) -> None:
        now, engine = self.snapshot(), self.engine
        kv = engine.kv_state()
        gpu_util, gpu_free = self.gpu.read()
        record = WorkerHeartbeat(
            worker_id=self.worker_id, pool=self.pool, engine=engine.name, models=self.models,
            loaded=list(engine.loaded or ()), state=self.state,
            partitions=sorted(now.partitions), capacity=engine.capacity,
            running=now.running, queued=0, ts_ms=now_ms(), host=self.host,
            gpu_utilization=gpu_util, gpu_memory_free=gpu_free,
            interactive_running=now.interactive_running, interactive_ms=now.interactive_ms,
            prefill_tps=self.speed.prefill_tps, tpot_ms=self.speed.tpot_ms,
            prefix_blocks=reported_blocks(self.held, engine, kv, self.settings),
            kv=kv, host_cache=engine.host_cache_stats(),
        )
        await self.sender.deliver(Output(WORKERS.at(self.settings.kafka), "WorkerHeartbeat",
                                         record, key=self.worker_id))


_RETRY_S = 60.0
_NONE = {"", "-1", "NoDevFiles"}


def visible_entries(value: str | None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``: None when unset (every GPU),
    [] for no GPU."""
    if value is None:
        return None
    if value.strip() in _NONE:
        return []
    return [entry.strip() for entry in value.split(",")]


class GpuProbe:
    """Reads the visible GPUs' utilisation and free memory (module docstring)."""

    def __init__(self, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 nvml: Callable[[], Any] | None = None) -> None:
        self._env = os.environ if env is None else env
        self._clock = clock
        self._load = nvml or _import_pynvml
        self._nvml: Any = None
        self._handles: list[tuple[Any, bool]] = []  # (handle, utilisation readable)
        self._failed_at: float | None = None

    def read(self) -> tuple[float | None, int | None]:
        """(mean utilisation in percent, free bytes summed), each None when unknown."""
        if not self._ready():
            return None, None
        nvml = self._nvml
        utils: list[float] = []
        free: list[int] = []
        for handle, has_util in self._handles:
            try:
                free.append(int(nvml.nvmlDeviceGetMemoryInfo(handle).free))
                if has_util:
                    utils.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            except nvml.NVMLError:
                # left out of this beat, but one that gives its memory and no
                # utilisation (a GPU in MIG mode: Not Supported) counts its memory
                continue
        return ((sum(utils) / len(utils)) if utils else None), (sum(free) if free else None)

    def _ready(self) -> bool:
        if self._nvml is not None:
            return True
        now = self._clock()
        if self._failed_at is not None and now - self._failed_at < _RETRY_S:
            return False
        try:
            nvml = self._load()
        except ImportError:  # no nvidia-ml-py: a CPU worker, nothing to say
            self._failed_at = now
            return False
        try:
            nvml.nvmlInit()
            self._handles = _handles(nvml, visible_entries(self._env.get("CUDA_VISIBLE_DEVICES")))
        except Exception as exc:  # no driver, no device
            if self._failed_at is None:
                log.info("no GPU figures in the heartbeat: NVML answered %r "
                         "(asked again once a minute)", exc)
            self._failed_at = now
            return False
        self._nvml = nvml
        return True


def _import_pynvml() -> Any:
    import pynvml  # type: ignore[import-not-found]

    return pynvml


def _handles(nvml: Any, entries: list[str] | None) -> list[tuple[Any, bool]]:
    count = nvml.nvmlDeviceGetCount()
    found: list[tuple[Any, bool]] = []
    for entry in [str(i) for i in range(count)] if entries is None else entries:
        if entry.isdigit() and int(entry) < count:
            found.append((nvml.nvmlDeviceGetHandleByIndex(int(entry)), True))
        elif entry.startswith(("GPU-", "MIG-")):
            handle = _by_uuid(nvml, entry, count)
            if handle is None:
                break
            found.append((handle, entry.startswith("GPU-")))
        else:
            break  # CUDA ignores this entry and every one after it
    return found


def _by_uuid(nvml: Any, entry: str, count: int) -> Any:
    """The device of a UUID, or of the one GPU whose UUID it begins (CUDA takes a
    unique prefix); None when there is none."""
    try:
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    except nvml.NVMLError:
        pass
    matches = []
    for i in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(entry):
            matches.append(handle)
    return matches[0] if len(matches) == 1 else None


ALPHA = 0.2
MIN_PREFILL_TOKENS = 16
MIN_DECODE_TOKENS = 4


@dataclass
class Speed:
    prefill_tps: float | None = None  # uncached prompt tokens a second
    tpot_ms: float | None = None  # milliseconds a token after the first

    def observe(self, prefill_tokens: int, first_s: float, decode_tokens: int,
                decode_s: float) -> None:
        """One generation: ``prefill_tokens`` uncached prompt tokens before its first
        token came ``first_s`` after it was asked, then ``decode_tokens`` more in
        ``decode_s``."""
        if prefill_tokens >= MIN_PREFILL_TOKENS and first_s > 0:
            self.prefill_tps = _ewma(self.prefill_tps, prefill_tokens / first_s)
        if decode_tokens >= MIN_DECODE_TOKENS and decode_s > 0:
            self.tpot_ms = _ewma(self.tpot_ms, 1000 * decode_s / decode_tokens)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - ALPHA) * old + ALPHA * sample

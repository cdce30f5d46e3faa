"""The Conveyor of the chaos run and the faults injected into it (:data:`FAULTS`,
described in docs/benchmarks/index.md), each undone as an operator or a
supervisor would, while streams run. :class:`Conveyor` is real processes
(every layer in one, infer workers, a gateway), each in its own process
group, on a Kafka and a Redis of their own (infra/services.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.chaos_load import Load
from bench.harness import BenchError, Proc, conveyor_cli, spawn, stop_all
from conveyor.settings import Settings
from infra.services import OwnKafka, OwnRedis, kill_group
from schemas.codec import default_codec
from schemas.records import WorkerHeartbeat
from topics.catalog import WORKERS
from topics.follow import follow

__all__ = ["FAULTS", "Chaos", "Heartbeats", "Injected", "Conveyor"]

log = logging.getLogger("bench.chaos")


@dataclass
class Heartbeats:
    """The latest heartbeat of each worker, read from ``conveyor.workers``."""

    settings: Settings
    beats: dict[str, WorkerHeartbeat] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)

    async def follow(self) -> None:
        """For ever, from the end at the start (through the broker's outages)."""
        async for batch in follow(self.settings, WORKERS, 0, "end").events(default_codec()):
            for _, beat in batch:
                self.beats[beat["worker_id"]] = beat
                self.seen_at[beat["worker_id"]] = time.monotonic()

    def busiest(self, workers: list[str]) -> str:
        return max(workers, key=lambda w: self.beats[w]["running"] if w in self.beats else 0)

    def ready(self, worker: str, since: float) -> bool:
        beat = self.beats.get(worker)
        return (beat is not None and self.seen_at.get(worker, 0.0) > since
                and beat["state"] == "ready" and bool(beat["partitions"]))


@dataclass
class Injected:
    name: str
    injected_at: float
    restored_at: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Chaos:
    """Everything a fault may break or wait for."""

    conveyor: Conveyor
    redis: OwnRedis
    kafka: OwnKafka
    load: Load
    beats: Heartbeats
    base_url: str
    injected: list[Injected] = field(default_factory=list)

    def strike(self, name: str, note: str) -> Injected:
        event = Injected(name, time.monotonic(), notes=[note])
        self.injected.append(event)
        log.info("fault %s: %s", name, note)
        return event

    async def wait_streaming(self, within: float = 15.0) -> None:
        """Until most clients are mid-answer (bounded)."""
        want = max(1, self.load.clients - 1)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if len(self.load.streaming()) >= want:
                return
            await asyncio.sleep(0.1)

    async def kill_worker(self, event: Injected | None, name: str) -> Injected:
        worker = self.beats.busiest(self.conveyor.workers)
        beat = self.beats.beats.get(worker)
        running = beat["running"] if beat is not None else None
        note = f"SIGKILL worker {worker} (running {running})"
        if event is None:
            event = self.strike(name, note)
        else:
            event.notes.append(note)
        await asyncio.to_thread(self.conveyor.kill, worker, signal.SIGKILL)
        event.notes.append(f"killed:{worker}")
        return event

    async def restart_worker(self, event: Injected, after: float) -> None:
        worker = next(n.split(":", 1)[1] for n in event.notes if n.startswith("killed:"))
        await asyncio.sleep(after)
        await asyncio.to_thread(self.conveyor.start, worker)

    async def recovered(self, within: float = 90.0, starting: bool = False) -> bool:
        """Until the gateway is healthy, every worker heartbeats ready again and a
        one-token completion comes back through the whole pipeline (health alone
        can say ok while a layer is stuck). ``starting``: any heartbeat counts, and
        a process that exits is a BenchError."""
        since = 0.0 if starting else time.monotonic()
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                for name, proc in self.conveyor.procs.items():
                    if starting and proc.exited() is not None:
                        raise BenchError(f"{name} exited early:\n{proc.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    healthy = (await client.get(f"{self.base_url}/healthz")).status_code == 200
                    if healthy and all(self.beats.ready(w, since)
                                       for w in self.conveyor.workers):
                        left = max(1.0, min(30.0, deadline - time.monotonic()))
                        probe = await client.post(
                            f"{self.base_url}/v1/completions", timeout=left,
                            json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1})
                        if probe.status_code == 200:
                            return True
                await asyncio.sleep(0.5)
        return False


async def _worker(c: Chaos) -> Injected:
    event = await c.kill_worker(None, "worker")
    await c.restart_worker(event, 3.0)
    return event


async def _layers(c: Chaos) -> Injected:
    event = c.strike("layers", "SIGKILL the layers process")
    await asyncio.to_thread(c.conveyor.kill, "layers", signal.SIGKILL)
    await asyncio.sleep(2.0)
    await asyncio.to_thread(c.conveyor.start, "layers")
    return event


async def _redis_stop(c: Chaos) -> Injected:
    event = c.strike("redis-stop", "Redis SIGKILLed for 3 s")
    await asyncio.to_thread(c.redis.stop, signal.SIGKILL)
    await asyncio.sleep(3.0)
    await asyncio.to_thread(c.redis.start)
    return event


async def _redis_flush(c: Chaos) -> Injected:
    event = c.strike("redis-flush", "Redis FLUSHALL")
    await asyncio.to_thread(c.redis.flush)
    return event


async def _kafka(c: Chaos) -> Injected:
    event = c.strike("kafka", "Kafka SIGKILLed for 5 s")
    await asyncio.to_thread(c.kafka.kill, signal.SIGKILL)
    await asyncio.sleep(5.0)
    started = time.monotonic()
    await asyncio.to_thread(c.kafka.start)
    event.notes.append(f"Kafka serving again {time.monotonic() - started:.1f} s after its start")
    return event


async def _worker_redis_down(c: Chaos) -> Injected:
    event = c.strike("worker-redis-down", "Redis SIGKILLed for 3 s")
    await asyncio.to_thread(c.redis.stop, signal.SIGKILL)
    await asyncio.sleep(1.0)
    await c.kill_worker(event, "worker-redis-down")
    await asyncio.sleep(2.0)
    await asyncio.to_thread(c.redis.start)
    await c.restart_worker(event, 1.0)
    return event


async def _redis_flush_worker(c: Chaos) -> Injected:
    event = c.strike("redis-flush-worker", "Redis FLUSHALL")
    await asyncio.to_thread(c.redis.flush)
    await c.kill_worker(event, "redis-flush-worker")
    await c.restart_worker(event, 3.0)
    return event


# In the order a full run injects them: Kafka last, so that a pipeline it
# leaves broken does not hide what the other faults do.
FAULTS: dict[str, Callable[[Chaos], Awaitable[Injected]]] = {
    "worker": _worker,
    "layers": _layers,
    "redis-stop": _redis_stop,
    "redis-flush": _redis_flush,
    "worker-redis-down": _worker_redis_down,
    "redis-flush-worker": _redis_flush_worker,
    "kafka": _kafka,
}


@dataclass
class Conveyor:
    """``conveyor layer`` (every layer), infer workers and a gateway, started and
    restarted by name; their output goes to ``<logs>/<name>.log`` (appended to on
    a restart, after a marker line)."""

    logs: Path
    env: dict[str, str]
    workers: list[str]
    contexts: int = 2
    procs: dict[str, Proc] = field(default_factory=dict)
    # exits the run did not cause: (monotonic time, name, exit code)
    unexpected: list[tuple[float, str, int]] = field(default_factory=list)
    _killed: set[str] = field(default_factory=set)

    def argv(self, name: str) -> list[str]:
        if name == "layers":
            args = ["layer"]
        elif name == "gateway":
            args = ["gateway"]
        else:
            args = ["infer", "--pool", "cpu", "--engine", "llamacpp", "--contexts",
                    str(self.contexts), "--worker-id", name]
        return [sys.executable, "-m", "cli", *args]

    def topics(self) -> None:
        conveyor_cli("conveyor topics failed", "topics", env=self.env, timeout_s=120)

    def start(self, name: str) -> None:
        self.procs[name] = spawn(name, self.argv(name), self.logs, self.env)
        self._killed.discard(name)

    def start_all(self) -> None:
        for name in ["layers", *self.workers, "gateway"]:
            self.start(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process group of ``name`` and wait for it to exit."""
        proc = self.procs[name]
        self._killed.add(name)
        if proc.exited() is None:
            kill_group(proc.popen.pid, sig)
            proc.popen.wait(timeout=30)

    def reap(self) -> list[str]:
        """The processes that exited without being killed by the run (recorded in
        ``unexpected``); the caller restarts them, as a supervisor would."""
        died = []
        for name, proc in self.procs.items():
            code = proc.exited()
            if code is not None and name not in self._killed:
                self.unexpected.append((time.monotonic(), name, code))
                self._killed.add(name)
                died.append(name)
        return died

    def close(self) -> None:
        stop_all(self.procs.values(), grace_s=15)

"""Chaos run: streamed load through a real Conveyor while its parts are broken
in turn, then a check against ``conveyor.tokens`` that every request got exactly
one answer identical to what the log holds, or a clear error.

The set-up, the faults, the outcomes, the flags and the exit codes:
docs/benchmarks/index.md. :class:`Conveyor` is real processes on a Kafka and a
Redis of their own (infra/services.py); each fault (:data:`FAULTS`) is undone
as an operator or a supervisor would, while streams run. No fault starts after
``--time-limit`` seconds; requests then in flight get their client deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.chaos_check import Injected, Load, Report, judge, read_tokens
from bench.harness import BenchError, Proc, as_script, conveyor_cli, conveyor_env, spawn
from conveyor.settings import Settings
from infra.services import OwnKafka, OwnRedis, ServiceError, free_port, stop_groups
from topics.envelope import now_ms
from workers.fleet import Fleet

__all__ = ["FAULTS", "Chaos", "Conveyor", "main"]

log = logging.getLogger("bench.chaos")


@dataclass
class Chaos:
    """Everything a fault may break or wait for."""

    conveyor: Conveyor
    redis: OwnRedis
    kafka: OwnKafka
    load: Load
    fleet: Fleet  # the workers' last heartbeats
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
        beats = self.fleet.beats
        worker = max(self.conveyor.workers, key=lambda w: beats[w]["running"] if w in beats else 0)
        running = beats[worker]["running"] if worker in beats else None
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

    def ready(self, worker: str, since_ms: int) -> bool:
        """Whether ``worker`` heartbeat ready, with partitions, after ``since_ms``."""
        beat = self.fleet.beats.get(worker)
        return (beat is not None and beat["ts_ms"] > since_ms and beat["state"] == "ready"
                and bool(beat["partitions"]))

    async def recovered(self, within: float = 90.0, starting: bool = False) -> bool:
        """Until the gateway is healthy, every worker heartbeats ready again and a
        one-token completion comes back through the whole pipeline (health alone
        can say ok while a layer is stuck). ``starting``: any heartbeat counts, and
        a process that exits is a BenchError."""
        since = 0 if starting else now_ms()
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                for name, proc in self.conveyor.procs.items():
                    if starting and proc.exited() is not None:
                        raise BenchError(f"{name} exited early:\n{proc.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    healthy = (await client.get(f"{self.base_url}/healthz")).status_code == 200
                    if healthy and all(self.ready(w, since)
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
    await asyncio.to_thread(c.kafka.stop, signal.SIGKILL)
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

    def start(self, name: str) -> None:
        self.procs[name] = spawn(name, self.argv(name), self.logs, self.env)
        self._killed.discard(name)

    def start_all(self) -> None:
        for name in ["layers", *self.workers, "gateway"]:
            self.start(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process group of ``name`` and wait for it to exit."""
        self._killed.add(name)
        stop_groups([self.procs[name].popen], sig, grace_s=30)

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
        stop_groups([proc.popen for proc in self.procs.values()], grace_s=15)


QUICK_FAULTS = ("worker", "redis-stop", "redis-flush-worker")
# about how long a fault takes from its strike to a healthy pipeline, quiet period aside
_FAULT_COST_S = {"kafka": 45.0}  # the others about 25 s
WORKER_IDS = ["w0", "w1"]
MAX_TOKENS = 64
REQUEST_TIMEOUT_S = 60.0  # the gateway's (CONVEYOR_REQUEST_TIMEOUT_S); clients wait 20 s more


def _options(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--faults", default=None,
                   help=f"comma-separated subset, in order (all: {','.join(FAULTS)})")
    p.add_argument("--quick", action="store_true",
                   help=f"about 2 minutes: {','.join(QUICK_FAULTS)}, short quiet periods")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no fault starts (default 420, quick 150)")
    p.add_argument("--max-requests", type=int, default=600, help="requests sent in all")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    opts = p.parse_args(argv)
    names = opts.faults.split(",") if opts.faults else list(
        QUICK_FAULTS if opts.quick else FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)}")
    opts.fault_names = names
    opts.time_limit = opts.time_limit or (150.0 if opts.quick else 420.0)
    opts.quiet = 5.0 if opts.quick else 12.0  # seconds of plain load after each fault
    opts.baseline = 8.0 if opts.quick else 15.0  # and before the first
    return opts


async def _supervise(conveyor: Conveyor) -> None:
    """Start again what died on its own, as a supervisor would (and say so)."""
    while True:
        for name in conveyor.reap():
            code = conveyor.unexpected[-1][2]
            log.warning("%s exited on its own (code %s): starting it again", name, code)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(conveyor.start, name)
        await asyncio.sleep(0.5)


async def _drive(opts: argparse.Namespace, chaos: Chaos, t0: float) -> tuple[
        list[Injected], list[str]]:
    """Baseline load, then each fault with a recovery and a quiet period."""
    chaos.load.start()
    log.info("load: %d clients, max_tokens %d; baseline %.0f s", opts.clients,
             MAX_TOKENS, opts.baseline)
    await asyncio.sleep(opts.baseline)
    skipped: list[str] = []
    for name in opts.fault_names:
        cost = _FAULT_COST_S.get(name, 25.0) + opts.quiet
        if time.monotonic() - t0 + cost > opts.time_limit or chaos.load.exhausted:
            skipped.append(name)
            continue
        await chaos.wait_streaming()
        event = await FAULTS[name](chaos)
        event.restored_at = time.monotonic()
        if await chaos.recovered():
            log.info("fault %s: answering again %.1f s after the strike", name,
                     time.monotonic() - event.injected_at)
        else:
            event.notes.append("NOT answering again within 90 s")
            log.warning("fault %s: NOT answering again %.1f s after the strike", name,
                        time.monotonic() - event.injected_at)
        await asyncio.sleep(opts.quiet)
    return chaos.injected, skipped


async def _run(opts: argparse.Namespace, conveyor: Conveyor, redis: OwnRedis,
               kafka: OwnKafka, base_url: str, t0: float) -> bool:
    settings = Settings.from_flat({k.removeprefix("CONVEYOR_").lower(): v
                                   for k, v in conveyor.env.items() if k.startswith("CONVEYOR_")})
    fleet = Fleet(settings)
    load = Load(base_url, opts.clients, MAX_TOKENS, opts.max_requests,
                client_deadline_s=REQUEST_TIMEOUT_S + 20.0)
    chaos = Chaos(conveyor, redis, kafka, load, fleet, base_url)
    background = [asyncio.create_task(fleet.follow()), asyncio.create_task(_supervise(conveyor))]
    try:
        if not await chaos.recovered(within=240.0, starting=True):
            raise BenchError("Conveyor did not become ready:\n" + "\n".join(
                p.log_tail(15) for p in conveyor.procs.values()))
        log.info("Conveyor ready after %.0f s", time.monotonic() - t0)
        try:
            injected, skipped = await _drive(opts, chaos, t0)
        except BaseException:
            load.abort()  # Ctrl-C or a failure: no drain, tear down at once
            raise
        load.stop()
        log.info("load stopped; waiting for %d requests in flight", len(load.in_flight()))
        await load.drain()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    verdicts = judge(load.records, await read_tokens(settings))
    report = Report(verdicts, injected, conveyor.unexpected, skipped)
    print("\n".join(report.lines()), flush=True)
    ok, line = report.verdict()
    print(line, flush=True)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    opts = _options(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="[%(relativeCreated)7.0f ms] %(message)s")
    for noisy in ("aiokafka", "kafka", "httpx"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-chaos-"))
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"chaos: faults {','.join(opts.fault_names)}; logs in {logs}", flush=True)
    with as_script("chaos", (BenchError, ServiceError)), ExitStack() as stack:
        redis = OwnRedis(workdir)
        stack.callback(redis.stop, signal.SIGKILL)
        kafka = OwnKafka(workdir)
        stack.callback(kafka.close)
        redis.start()
        kafka.start()  # the jars linked (fetched once) first
        log.info("own Redis on %s, own Kafka on %s", redis.url, kafka.bootstrap)
        prefix = f"chaos{int(time.time())}"
        port = free_port()
        env = conveyor_env(topic_prefix=prefix, gateway_port=port, services={
            "CONVEYOR_KAFKA_BOOTSTRAP": kafka.bootstrap, "CONVEYOR_REDIS_URL": redis.url,
            "CONVEYOR_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)})
        conveyor = Conveyor(logs, env, list(WORKER_IDS))
        stack.callback(conveyor.close)
        conveyor_cli("conveyor topics failed", "topics", env=env, timeout_s=120)
        conveyor.start_all()
        ok = asyncio.run(_run(opts, conveyor, redis, kafka, f"http://127.0.0.1:{port}", t0))
    print(f"chaos: done in {time.monotonic() - t0:.0f} s; logs in {logs}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("chaos: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(130)

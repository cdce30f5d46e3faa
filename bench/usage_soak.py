"""A soak of the accounting app: its memory over 200,000 usage events, how fast a
SIGKILLed member's successor restores the ledger and counts again.

    bash infra/kafka.sh start
    .venv/bin/python -m bench.usage_soak [--quick] [--events N] [--step N]
                                         [--tenants N] [--app-root PATH]

Against the running Kafka, under a fresh topic prefix (``usagesoak<unix
time>``), with a redis-server of its own on a free port (so the ledger's
copy can be flushed without touching anyone else's), the script runs
``conveyor accounting`` from ``--app-root`` (default: this checkout; give
another checkout, a ``git worktree`` of an older commit, to compare) and:

1. sends one usage event and waits until it is counted (the cold start);
2. sends ``--events`` UsageRecords (default 200,000, keyed by tenant as
   postprocess writes them, ``--tenants`` tenants; one in 50 is a second copy
   of a request sent 37 events before, which must not be counted) in steps
   of ``--step``; after each step it waits until the ledger in Redis shows
   every request of it and prints the app's RSS (``VmRSS`` of its process);
3. checks the totals (each request once, no repeat counted);
4. SIGKILLs the app, flushes its Redis and starts a successor at once, while
   the dead member is still registered in the group, then sends one more
   event: it prints how long until the soak's totals are back in Redis (the
   tables restored from their changelog and mirrored), until the new event
   is counted, and the successor's RSS.

Every wait is bounded (``--wait-s``, default 300 s); the app is stopped
(SIGTERM, then SIGKILL) on exit, Ctrl-C or SIGTERM; its logs stay in the
``/tmp/conveyor-bench-usage-soak-*`` folder the script prints. ``--quick``
sends 40,000 events in steps of 5,000. The figures are one process on a
shared machine: read RSS as a shape (flat or growing), times as orders of
magnitude.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis.asyncio as aioredis

from bench.chaos_services import ChaosRedis, free_port
from bench.harness import BenchError, Proc, exit_on_sigterm, port_answers, repo_root
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import UsageRecord
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from topics.envelope import new_request_id, now_ms
from workers.usage import UsageLedger

__all__ = ["main"]

REPEAT_EVERY = 50  # one event in this many is a second copy of an earlier request
REPEAT_GAP = 37  # ... of the request sent this many events before

# ``conveyor accounting`` as the checkout at --app-root spells it (before the
# command line became its own package, cli/, it was conveyor/cli.py)
RUN_ACCOUNTING = """
import sys
try:
    from conveyor.cli import main
except ImportError:
    from cli.main import main
sys.exit(main(["accounting"]))
"""


@dataclass
class AccountingProcess:
    """``conveyor accounting`` run from ``root`` (its own process group)."""

    root: Path
    env: dict[str, str]
    log_dir: Path
    runs: int = 0
    proc: Proc | None = None

    def start(self) -> None:
        self.runs += 1
        log_path = self.log_dir / f"accounting-{self.runs}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen([sys.executable, "-c", RUN_ACCOUNTING], cwd=self.root,
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.proc = Proc(f"accounting-{self.runs}", popen, log_path)

    def alive(self) -> Proc:
        if self.proc is None or self.proc.exited() is not None:
            tail = self.proc.log_tail() if self.proc is not None else ""
            raise BenchError(f"the accounting app is not running; its log ends:\n{tail}")
        return self.proc

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.alive().popen.pid}/status").read_text()
        kb = next(int(line.split()[1]) for line in status.splitlines()
                  if line.startswith("VmRSS:"))
        return kb / 1024

    def kill(self) -> None:
        proc = self.alive()
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class Traffic:
    """The soak's usage events: new requests, and now and then a second copy."""

    tenants: int
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    sent: int = 0
    unique: int = 0
    recent: list[UsageRecord] = field(default_factory=list)

    def tenant_names(self) -> list[str]:
        return [f"soak{i}" for i in range(self.tenants)]

    def next(self) -> UsageRecord:
        """A new request, or every ``REPEAT_EVERY``th a second copy of an earlier one."""
        if (self.sent + 1) % REPEAT_EVERY == 0 and len(self.recent) >= REPEAT_GAP:
            self.sent += 1
            return self.recent[-REPEAT_GAP]
        return self.new()

    def new(self) -> UsageRecord:
        self.sent += 1
        self.unique += 1
        now = now_ms()
        record = UsageRecord(request_id=new_request_id(),
                             tenant=f"soak{self.unique % self.tenants}",
                             key_id=f"k{self.unique % 7}", model=f"m{self.unique % 3}",
                             kind="chat", status="completed", prompt_tokens=2,
                             completion_tokens=1, entered_ms=now - 300, finished_ms=now)
        self.recent.append(record)
        del self.recent[:-REPEAT_GAP]
        return record


async def send(settings: Settings, records: list[UsageRecord]) -> None:
    codec = default_codec()
    producer = make_producer(settings)
    await producer.start()
    try:
        for record in records:
            await producer.send(settings.topic("usage"), codec.encode("UsageRecord", record),
                                key=record["tenant"].encode())
        await producer.flush()
    finally:
        await producer.stop()


async def requests_counted(ledger: UsageLedger, tenants: list[str], since_ms: int) -> int:
    total = 0
    for tenant in tenants:
        rows = await ledger.report(tenant, since_ms=since_ms, until_ms=now_ms() + 1, by="day")
        total += sum(row.requests for row in rows)
    return total


async def wait_for(check: Callable[[], Awaitable[bool]], app: AccountingProcess,
                   timeout_s: float, what: str) -> float:
    """Seconds until ``check`` holds; BenchError after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if await check():
            return time.monotonic() - started
        app.alive()
        await asyncio.sleep(0.1)
    raise BenchError(f"{what}: not within {timeout_s:.0f} s (log {app.alive().log_path})")


async def soak(args: argparse.Namespace, settings: Settings, app: AccountingProcess,
               redis: aioredis.Redis) -> None:
    ledger = UsageLedger(settings, redis)
    since = now_ms() - 60_000
    traffic = Traffic(args.tenants)
    tenants = traffic.tenant_names()
    app.start()
    await send(settings, [traffic.next()])
    cold = await wait_for(lambda: _at_least(ledger, tenants, since, 1), app, args.wait_s,
                          "the first event")
    print(f"cold start: first event counted {cold:.1f} s after the app started "
          f"(RSS {app.rss_mb():.0f} MB)")
    print(f"{'events':>8} {'unique':>8} {'RSS MB':>7} {'events/s':>9}")
    rss: list[float] = []
    while traffic.sent < args.events:
        batch = [traffic.next() for _ in range(min(args.step, args.events - traffic.sent))]
        started = time.monotonic()
        await send(settings, batch)
        await wait_for(partial(_at_least, ledger, tenants, since, traffic.unique), app,
                       args.wait_s, f"{traffic.sent} events")
        rate = len(batch) / (time.monotonic() - started)
        rss.append(app.rss_mb())
        print(f"{traffic.sent:>8} {traffic.unique:>8} {rss[-1]:>7.0f} {rate:>9.0f}")
    await asyncio.sleep(2)  # a repeat counted late would show now
    counted = await requests_counted(ledger, tenants, since)
    if counted != traffic.unique:
        raise BenchError(f"the ledger counts {counted} requests; {traffic.unique} were sent "
                         f"(and {traffic.sent - traffic.unique} repeats)")
    print(f"ledger: {counted} requests, each once ({traffic.sent - traffic.unique} repeats "
          f"dropped); RSS {rss[0]:.0f} MB after the first step, {rss[-1]:.0f} MB after "
          f"the last ({rss[-1] - rss[0]:+.0f} MB)")
    await takeover(args, settings, app, ledger, traffic, since, counted)


async def takeover(args: argparse.Namespace, settings: Settings, app: AccountingProcess,
                   ledger: UsageLedger, traffic: Traffic, since: int, counted: int) -> None:
    """SIGKILL, flush Redis, start a successor at once; then a second copy of a
    request the dead member counted, a new request of the same tenant and one of
    a tenant of its own."""
    app.kill()
    await ledger.redis.flushall()
    app.start()
    started = time.monotonic()
    copy = traffic.recent[-1]
    await send(settings, [copy, traffic.new(), probe_record()])
    tenants = traffic.tenant_names()

    async def after_start(tenants: list[str], want: int, what: str) -> float:
        await wait_for(partial(_at_least, ledger, tenants, since, want), app, args.wait_s,
                       what)
        return time.monotonic() - started

    restored, hot, new = await asyncio.gather(
        after_start(tenants, counted, "the restored totals"),
        after_start(tenants, counted + 1, "the new request of a soak tenant"),
        after_start(["probe"], 1, "the request of a new tenant"))
    await asyncio.sleep(2)
    if (again := await requests_counted(ledger, tenants, since)) != counted + 1:
        raise BenchError(f"after the restart the ledger counts {again - counted} new requests "
                         f"of the soak's tenants; 1 was sent (and a second copy of another)")
    print(f"successor (started right after the SIGKILL): totals back in Redis {restored:.1f} s "
          f"after its start, a new request counted after {hot:.1f} s on a soak partition "
          f"(the copy dropped) and {new:.1f} s on another; RSS {app.rss_mb():.0f} MB")
    for line in app.alive().log_path.read_text(errors="replace").splitlines():
        if "read back in" in line or "Recovery]: Done" in line:
            print("  " + line)


def probe_record() -> UsageRecord:
    now = now_ms()
    return UsageRecord(request_id=new_request_id(), tenant="probe", key_id="k", model="m",
                       kind="chat", status="completed", prompt_tokens=1, completion_tokens=1,
                       entered_ms=now, finished_ms=now)


async def _at_least(ledger: UsageLedger, tenants: list[str], since: int, want: int) -> bool:
    return await requests_counted(ledger, tenants, since) >= want


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.usage_soak", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--step", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--wait-s", type=float, default=300.0)
    parser.add_argument("--app-root", type=Path, default=repo_root(),
                        help="the checkout whose accounting app runs (default: this one)")
    parser.add_argument("--quick", action="store_true", help="40,000 events, steps of 5,000")
    args = parser.parse_args(argv)
    if args.quick:
        args.events, args.step = 40_000, 5_000
    if args.events < 1 or args.step < 1 or args.tenants < 1:
        parser.error("--events, --step and --tenants must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    exit_on_sigterm()
    kafka_port = int(Settings().kafka_bootstrap.split(",")[0].rsplit(":", 1)[1])
    if not port_answers(kafka_port):
        print(f"bench.usage_soak: Kafka is not answering on port {kafka_port}: run "
              "`bash infra/kafka.sh start`", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-usage-soak-"))
    redis_server = ChaosRedis(log_dir)
    redis_server.start()
    prefix = f"usagesoak{int(time.time())}"
    settings = Settings(topic_prefix=prefix, redis_url=redis_server.url)
    env = {**os.environ, "CONVEYOR_TOPIC_PREFIX": prefix, "CONVEYOR_REDIS_URL": redis_server.url,
           "CONVEYOR_METRICS_PORT": str(free_port())}
    app = AccountingProcess(args.app_root.resolve(), env, log_dir)
    print(f"accounting app from {app.root}, topic prefix {prefix}, logs in {log_dir}")
    try:
        asyncio.run(_run(args, settings, app))
    except BenchError as exc:
        print(f"bench.usage_soak: {exc}", file=sys.stderr)
        return 1
    finally:
        app.stop()
        redis_server.stop()
    return 0


async def _run(args: argparse.Namespace, settings: Settings, app: AccountingProcess) -> None:
    needed = {settings.topic("usage"), settings.topic("dlq")}
    await ensure_topics(settings, [spec for spec in catalog(settings) if spec.name in needed])
    redis = aioredis.from_url(settings.redis_url)
    try:
        await soak(args, settings, app, redis)
    finally:
        await redis.aclose()


if __name__ == "__main__":
    sys.exit(main())

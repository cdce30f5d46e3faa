"""The accounting app for real: ``conveyor accounting`` (the command that
conveyor/cli_usage.py registers) in a process of its own, on the real Kafka
under a topic prefix of the module's own and a redis-server of its own (the
one the ``own_redis`` fixture hands out, started once for the module so that
one app run serves every test). Usage events go in through the usage topic;
what comes out is read with UsageLedger, as the CLI and the quota check read
it.

The tests run in order on one app: the restart test SIGKILLs and restarts
it, the last one stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import Control, Feedback, UsageRecord
from tests.support.pipeline import ROOT
from tests.support.services import OwnRedis, free_port
from tests.support.usage import quota_total
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from topics.envelope import now_ms
from workers.usage import UsageLedger, UsageRow

# ``conveyor accounting`` through the parser register() builds (conveyor/cli.py
# calls the same register with its own subparsers)
RUN_ACCOUNTING = """
import argparse, sys
from cli.usage import register
from conveyor.settings import load_settings
parser = argparse.ArgumentParser(prog="conveyor")
register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(["accounting"])
sys.exit(args.func(load_settings(), args))
"""


log = logging.getLogger(__name__)

# how soon a SIGKILLed app's successor counts a new event: 4.7-9.9 s in 20
# runs on two busy cores (workers/usage/app.py, Membership); over 30 s once at
# a load average of 19 (the suite in four processes beside two vLLM engines)
SUCCESSOR_COUNTS_WITHIN_S = 45.0


@dataclass
class Accounting:
    settings: Settings
    redis: OwnRedis
    logs: Path
    home: Path
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0
    metrics_port: int = field(default_factory=free_port)
    script: str = RUN_ACCOUNTING  # what the process runs (a test may patch Faust first)

    def start(self) -> None:
        env = {**os.environ, "CONVEYOR_TOPIC_PREFIX": self.settings.kafka.topic_prefix,
               "CONVEYOR_REDIS_URL": self.redis.url,
               "CONVEYOR_KAFKA_BOOTSTRAP": self.settings.kafka.bootstrap,
               "CONVEYOR_HOME": str(self.home),
               # a SIGKILLed member leaves the group after this, so a restart is quick
               "CONVEYOR_CONSUMER_SESSION_TIMEOUT_MS": "3000",
               "CONVEYOR_CONSUMER_HEARTBEAT_INTERVAL_MS": "500",
               "CONVEYOR_METRICS_PORT": str(self.metrics_port),
               # the suite fills the cores: the bounds here are at full priority
               "CONVEYOR_ACCOUNTING_NICE": "0"}
        self.runs += 1
        log = open(self.logs / f"accounting-{self.runs}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-c", self.script], env=env,
                                     stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def signal(self, sig: int, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return (self.logs / f"accounting-{self.runs}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def accounting(services: None, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Accounting]:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    needed = {settings.kafka.topic("usage"), settings.kafka.topic("dlq"),
              settings.kafka.topic("feedback")}
    asyncio.run(ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name in needed]))
    redis = OwnRedis(tmp_path_factory.mktemp("redis")).start()
    app = Accounting(settings, redis, tmp_path_factory.mktemp("logs"),
                     tmp_path_factory.mktemp("home"))
    app.start()
    try:
        yield app
    finally:
        if app.proc is not None and app.proc.poll() is None:
            app.proc.kill()
            app.proc.wait(timeout=10)
        redis.stop(signal.SIGKILL)


@pytest.fixture
async def ledger(accounting: Accounting) -> AsyncIterator[UsageLedger]:
    client = aioredis.from_url(accounting.redis.url)
    try:
        yield UsageLedger(accounting.settings, client)
    finally:
        await client.aclose()


def usage(rid: str, tenant: str, *, key_id: str = "k1", model: str = "m1",
          status: str = "completed", prompt: int = 10, completion: int = 5) -> UsageRecord:
    now = now_ms()
    return UsageRecord(request_id=rid, tenant=tenant, key_id=key_id, model=model, kind="chat",
                       status=status, prompt_tokens=prompt, completion_tokens=completion,
                       entered_ms=now - 300, finished_ms=now)


async def produce(settings: Settings, *values: UsageRecord | tuple[str, bytes]) -> None:
    """Usage records (keyed by tenant, as postprocess writes them), or raw (key, bytes)."""
    codec = default_codec()
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for value in values:
            if isinstance(value, tuple):
                key, data = value
            else:
                key, data = value["tenant"], codec.encode("UsageRecord", value)
            await producer.send_and_wait(settings.kafka.topic("usage"), data, key=key.encode())
    finally:
        await producer.stop()


async def backlog(settings: Settings, records: list[UsageRecord]) -> None:
    """Usage records sent at once, without waiting for each (a backlog the app
    works through), keyed by tenant as postprocess writes them."""
    codec = default_codec()
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for record in records:
            await producer.send(settings.kafka.topic("usage"), codec.encode("UsageRecord", record),
                                key=record["tenant"].encode())
        await producer.flush()
    finally:
        await producer.stop()


async def eventually(check: Callable[[], Awaitable[bool]], within: float,
                     app: Accounting) -> float:
    """Seconds until ``check`` holds; fails after ``within`` with the app's log."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if await check():
            return time.monotonic() - start
        assert app.proc is not None and app.proc.poll() is None, app.log()[-3000:]
        await asyncio.sleep(0.2)
    log = app.log()
    # the whole run's milestones, not only the log's end: a stall is decided at the
    # last assignment or recovery, often long before the end
    notable = "\n".join([line for line in log.splitlines()
                         if any(mark in line for mark in _NOTABLE)][-80:])
    raise AssertionError(f"not within {within} s; the app's assignments, recoveries and "
                         f"warnings:\n{notable}\napp log's end:\n{log[-2000:]}")


_NOTABLE = ("this member now holds", "Recovery", "ebalanc", "Worker ready", "dead-lettered",
            "WARNING", "ERROR")


def totals(rows: list[UsageRow]) -> tuple[int, int, int, int, int]:
    return (sum(r.requests for r in rows), sum(r.errors for r in rows),
            sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows),
            sum(r.total_tokens for r in rows))


async def today(ledger: UsageLedger, tenant: str, **which: Any) -> tuple[int, ...]:
    now = now_ms()
    return totals(await ledger.report(tenant, since_ms=now - 3_600_000, until_ms=now + 1,
                                      **which))


async def test_each_request_is_counted_once_by_tenant_key_and_model_per_minute_and_day(
        accounting: Accounting, ledger: UsageLedger) -> None:
    s = accounting.settings
    await produce(s, usage("r1", "acme"),
                  usage("r2", "acme", model="m2", status="error", completion=0),
                  usage("r3", "acme", key_id="k2", prompt=7, completion=3),
                  usage("r1", "acme"),  # postprocess wrote it twice
                  usage("z1", "zeta", prompt=100, completion=1))

    async def three() -> bool:
        # zeta's events are in another partition, which may be counted a mirror
        # tick after acme's (test_usage_index.py saw it on a loaded machine)
        return (await today(ledger, "acme"))[0] >= 3 and (await today(ledger, "zeta"))[0] >= 1

    await eventually(three, 90, accounting)  # the first start of Faust included
    assert await today(ledger, "acme") == (3, 1, 27, 8, 35)
    assert await today(ledger, "acme", key_id="k1") == (2, 1, 20, 5, 25)
    assert await today(ledger, "acme", key_id="k2") == (1, 0, 7, 3, 10)
    assert await today(ledger, "acme", model="m1") == (2, 0, 17, 8, 25)
    assert await today(ledger, "acme", model="m2") == (1, 1, 10, 0, 10)
    assert await today(ledger, "acme", by="minute") == (3, 1, 27, 8, 35)
    assert await today(ledger, "acme", by="minute", key_id="k2") == (1, 0, 7, 3, 10)
    assert await today(ledger, "zeta") == (1, 0, 100, 1, 101)
    assert await quota_total(ledger, "acme", "day") == 35
    assert await quota_total(ledger, "acme", "month") >= 35

    # another copy of r1 long after the first, then a new request behind it in
    # the same partition: once the new one is counted, the copy was dropped
    await produce(s, usage("r1", "acme"), usage("r4", "acme", key_id="k3", prompt=1,
                                                completion=1))

    async def four() -> bool:
        return (await today(ledger, "acme"))[0] >= 4

    await eventually(four, 20, accounting)
    assert await today(ledger, "acme") == (4, 1, 28, 9, 37)
    assert await today(ledger, "acme", key_id="k1") == (2, 1, 20, 5, 25)
    assert await quota_total(ledger, "acme", "day") == 37


async def test_faust_keeps_its_data_directory_under_the_conveyor_home(
        accounting: Accounting) -> None:
    """Not in the directory the app was started from (the repository here)."""
    app_id = accounting.settings.kafka.group("accounting")

    async def made() -> bool:  # at Faust's first start
        return (accounting.home / "accounting" / app_id / "v1").is_dir()

    await eventually(made, 60, accounting)
    assert not list(ROOT.glob(f"{app_id}*")), "Faust's data directory in the current one"


async def test_a_poison_value_goes_to_the_dlq_and_counting_goes_on(
        accounting: Accounting, ledger: UsageLedger) -> None:
    s = accounting.settings
    control = default_codec().encode("Control", Control(request_id="c", action="cancel",
                                                       reason="", ts_ms=now_ms()))
    await produce(s, ("poison", b"not an event"), ("poison", control),
                  usage("p1", "poison", prompt=3, completion=4))

    async def counted() -> bool:
        return (await today(ledger, "poison"))[0] == 1

    await eventually(counted, 20, accounting)
    letters = await dead_letters(s, want=2)
    assert [(d["layer"], d["topic"], d["key"], d["value"]) for d in letters] == [
        ("accounting", s.kafka.topic("usage"), b"poison", b"not an event"),
        ("accounting", s.kafka.topic("usage"), b"poison", control)]
    assert "Control" in letters[1]["error"]
    assert letters[0]["offset"] + 1 == letters[1]["offset"]
    assert await today(ledger, "poison") == (1, 0, 3, 4, 7)
    # and its metrics count them as a layer's
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"http://127.0.0.1:{accounting.metrics_port}/metrics")).text
    assert _metric(text, "conveyor_layer_dead_letters_total") == 2
    assert _metric(text, "conveyor_layer_events_total") >= 3


def _metric(text: str, name: str) -> float:
    """The accounting layer's sample of ``name`` in a Prometheus exposition."""
    [line] = [line for line in text.splitlines() if line.startswith(name + "{")
              and 'conveyor_layer="accounting"' in line]
    return float(line.rsplit(" ", 1)[1])


async def dead_letters(settings: Settings, want: int) -> list[dict[str, Any]]:
    codec = default_codec()
    consumer = AIOKafkaConsumer(settings.kafka.topic("dlq"),
                                bootstrap_servers=settings.kafka.bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    found: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 15
        while len(found) < want and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                found += [codec.decode(r.value, "DeadLetter") for r in records]
    finally:
        await consumer.stop()
    return found


async def test_redis_losing_everything_heals_within_seconds_without_new_traffic(
        accounting: Accounting, ledger: UsageLedger) -> None:
    await produce(accounting.settings, usage("h1", "heal", prompt=40, completion=2),
                  usage("h2", "heal", model="m9", prompt=8, completion=0))

    async def counted() -> bool:
        return (await today(ledger, "heal"))[0] == 2

    await eventually(counted, 20, accounting)
    accounting.redis.flush()
    assert await quota_total(ledger, "heal", "day") in (0, 50)  # gone, or healed already

    async def healed() -> bool:
        return (await today(ledger, "heal") == (2, 0, 48, 2, 50)
                and await today(ledger, "heal", model="m9") == (1, 0, 8, 0, 8)
                and await quota_total(ledger, "heal", "day") == 50
                and await quota_total(ledger, "heal", "month") == 50)

    assert await eventually(healed, 10, accounting) < 10


async def test_a_killed_app_restores_its_totals_from_the_changelog(
        accounting: Accounting, ledger: UsageLedger) -> None:
    s = accounting.settings
    await produce(s, usage("k1", "restart", prompt=10, completion=10),
                  usage("k2", "restart", key_id="k9", prompt=20, completion=5))

    async def two() -> bool:
        return (await today(ledger, "restart"))[0] == 2

    await eventually(two, 20, accounting)

    async def committed() -> bool:
        return await committed_to_end(s)

    # the app committed past every event: the new run does not read them again,
    # so their counts can only come back from the changelog
    await eventually(committed, 15, accounting)
    assert accounting.signal(signal.SIGKILL) == -signal.SIGKILL
    # Redis forgets too: whatever the new run shows comes from the changelog
    accounting.redis.flush()
    accounting.start()
    # a repeat of a request counted by the killed run, and a new one
    await produce(s, usage("k2", "restart", key_id="k9", prompt=20, completion=5),
                  usage("k3", "restart", prompt=1, completion=2))

    async def three() -> bool:
        return (await today(ledger, "restart"))[0] >= 3

    # a process start, the dead member's session (3 s here), a join and the
    # restore: seconds (logged: ``-o log_cli=true`` shows how many)
    took = await eventually(three, SUCCESSOR_COUNTS_WITHIN_S, accounting)
    log.info("the successor counted a new event %.2f s after its start", took)
    assert await today(ledger, "restart") == (3, 0, 31, 17, 48)
    assert await today(ledger, "restart", key_id="k9") == (1, 0, 20, 5, 25)
    assert await quota_total(ledger, "restart", "day") == 48
    # the earlier tests' tenants were restored as well (other partitions too)
    assert await today(ledger, "acme") == (4, 1, 28, 9, 37)
    assert await today(ledger, "heal") == (2, 0, 48, 2, 50)


async def committed_to_end(settings: Settings) -> bool:
    """Whether the app's group has committed every partition of the usage topic
    up to its end."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    await consumer.start()
    try:
        tps = [TopicPartition(settings.kafka.topic("usage"), p)
               for p in range(settings.kafka.pipeline_partitions)]
        ends = await consumer.end_offsets(tps)
        done = await admin.list_consumer_group_offsets(settings.kafka.group("accounting"))
        return all(ends[tp] == 0 or (tp in done and done[tp].offset == ends[tp])
                   for tp in tps)
    finally:
        await consumer.stop()
        await admin.close()


async def test_a_kill_in_the_middle_of_a_stream_loses_and_doubles_no_count(
        accounting: Accounting, ledger: UsageLedger) -> None:
    """SIGKILL while the app works through a backlog (commits, changelog writes
    and reads all in flight): once restarted, every request is counted once."""
    s = accounting.settings
    n = 1400
    await backlog(s, [usage(f"soak-{i}", "soak", key_id=f"k{i % 7}", model=f"m{i % 3}",
                            prompt=2, completion=1) for i in range(n)])

    async def some() -> bool:
        return (await today(ledger, "soak"))[0] >= n // 10

    await eventually(some, 60, accounting)
    assert accounting.signal(signal.SIGKILL) == -signal.SIGKILL
    accounting.start()

    async def all_of_them() -> bool:
        return (await today(ledger, "soak"))[0] >= n

    await eventually(all_of_them, 120, accounting)
    await asyncio.sleep(2)  # any late repeat would be counted by now
    assert await today(ledger, "soak") == (n, 0, 2 * n, n, 3 * n)
    assert await today(ledger, "soak", key_id="k0") == (200, 0, 400, 200, 600)  # i % 7 == 0
    assert await quota_total(ledger, "soak", "day") == 3 * n


async def test_a_member_joining_then_the_first_killed_loses_and_doubles_no_count(
        accounting: Accounting, ledger: UsageLedger, tmp_path: Path) -> None:
    """Rows reach the changelog once a commit (workers/usage/changelog.py):
    a second member joins mid-backlog (the first gives up partitions, with
    rows it had not sent yet), then the first is SIGKILLed and the second
    takes everything over. Every request of four tenants is counted once."""
    s = accounting.settings
    tenants = ["rb-a", "rb-b", "rb-c", "rb-d"]  # spread over the partitions
    n = 1200
    await backlog(s, [usage(f"rb-{i}", tenants[i % 4], prompt=2, completion=1)
                      for i in range(n)])

    async def counted() -> int:
        return sum([(await today(ledger, t))[0] for t in tenants])

    async def some() -> bool:
        return await counted() >= n // 10

    await eventually(some, 60, accounting)
    second = Accounting(s, accounting.redis, tmp_path, tmp_path / "home")
    second.start()
    try:
        async def more() -> bool:
            return await counted() >= n // 3

        await eventually(more, 60, second)
        assert accounting.signal(signal.SIGKILL) == -signal.SIGKILL

        async def all_of_them() -> bool:
            return await counted() >= n

        await eventually(all_of_them, 120, second)
        await asyncio.sleep(2)  # any late repeat would be counted by now
        for t in tenants:
            assert await today(ledger, t) == (n // 4, 0, n // 2, n // 4, 3 * n // 4), t
    finally:
        if second.proc is not None and second.proc.poll() is None:
            second.signal(signal.SIGKILL)
        accounting.start()  # the module's app, for the tests after this one


async def test_ratings_survive_a_kill_mid_stream_and_a_flush_latest_once(
        accounting: Accounting, ledger: UsageLedger) -> None:
    """Ratings (workers/usage/ratings.py) under the same faults: each of 300
    requests rated twice (the second rating is the one that counts), the app
    SIGKILLed while it works through them and Redis flushed; once restarted,
    each request counts once with its latest score."""
    s = accounting.settings
    n = 300
    codec = default_codec()
    producer = make_producer(s.kafka)
    await producer.start()
    try:
        # a value that is not a Feedback: dead-lettered, counting goes on
        await producer.send(s.kafka.topic("feedback"), b"not a rating", key=b"poison")
        for round_ in (0, 1):
            for i in range(n):
                rid = f"rated-{i}"
                event = Feedback(request_id=rid, tenant="raters", key_id="k", labels=[],
                                 score=-1.0 if round_ == 0 else (1.0 if i % 3 else 0.5),
                                 comment="", model="m", answered_by=f"m-v{i % 2}",
                                 latency_ms=10, ts_ms=int(time.time() * 1000))
                await producer.send(s.kafka.topic("feedback"), codec.encode("Feedback", event),
                                    key=rid.encode())
        await producer.flush()
    finally:
        await producer.stop()
    since = int(time.time() * 1000) - 86_400_000
    until = since + 2 * 86_400_000

    async def rated(at_least: int) -> bool:
        days = await ledger.ratings("raters", since_ms=since, until_ms=until)
        return bool(days) and days[-1].count >= at_least

    await eventually(lambda: rated(n // 10), 60, accounting)
    assert accounting.signal(signal.SIGKILL) == -signal.SIGKILL
    accounting.redis.flush()
    accounting.start()

    async def settled() -> bool:
        days = await ledger.ratings("raters", since_ms=since, until_ms=until)
        return bool(days) and days[-1].count == n and days[-1].mean is not None \
            and days[-1].mean > 0.8

    await eventually(settled, 120, accounting)
    await asyncio.sleep(2)
    [day] = await ledger.ratings("raters", since_ms=since, until_ms=until)
    # latest scores: 100 requests at 0.5 (i % 3 == 0), 200 at 1.0
    assert (day.count, day.mean) == (n, round((100 * 0.5 + 200 * 1.0) / n, 4))
    assert day.by_model == {"m": {"count": n, "mean": day.mean}}
    assert {d: c["count"] for d, c in day.by_deployment.items()} == {"m-v0": 150, "m-v1": 150}
    letters = [d for d in await dead_letters(s, want=3) if d["topic"] == s.kafka.topic("feedback")]
    # (a replay after the kill may write the letter again: at-least-once, as the layers)
    assert letters and {(d["layer"], d["key"], d["value"]) for d in letters} == {
        ("accounting", b"poison", b"not a rating")}


async def test_sigterm_stops_the_app_cleanly(accounting: Accounting) -> None:
    assert accounting.signal(signal.SIGTERM) == 0
    log = accounting.log()
    assert "Traceback" not in log, log[-3000:]

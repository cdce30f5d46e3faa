"""A table recovery that ends in the middle of the next rebalance.

faust-streaming's ``Recovery`` finishes a generation's recovery (resumes the
stream partitions, the agents' and the consumer's flow, and calls the
rebalance done) unless the consumer's generation has changed, and the
generation changes only when the next assignment arrives. A recovery that
ends between the next rebalance's revocation and its assignment (the join
in between waits for every member the group still counts, a dead one up to
its session's end) resumed everything in the middle of that rebalance; the
assignment then made its partitions fetchable before pausing them, and a
record of a partition the member never held reached Faust's conductor before
its index knew the partition: a KeyError, and the app crashed (every run
before workers/usage/flow.py ended such a recovery; why:
docs/decisions/0002-faust-on-the-cold-path-only.md, "The ratings stall").

The test forces that order in a member of its own (``HELD``: its first
recovery's end waits for the next revocation, that assignment waits for the
recovery's end, as a slow join would, and the loop is slow for 1.5 s between
the assignment and its pause, as on a loaded machine) and checks what the
accounting app promises: the member keeps counting, every rating once, with
the latest score.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import Feedback
from tests.faults.workers.usage.test_usage_app import (
    RUN_ACCOUNTING,
    Accounting,
    eventually,
)
from tests.support.services import OwnRedis
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from workers.usage import UsageLedger

# The member whose first recovery ends mid-rebalance: Faust's own code, with
# the recovery's end held until the next revocation is done, that rebalance's
# assignment held (in the consumer's thread, before the generation changes)
# until the recovery's end has returned, and then the loop slow for 1.5 s
# between the assignment and its pause of the assigned partitions.
HELD = """
import asyncio, logging, threading
from faust.tables.recovery import Recovery
from faust.transport.drivers.aiokafka import ConsumerRebalanceListener

log = logging.getLogger("test.held")
holding, released = threading.Event(), threading.Event()
keep = []
complete = Recovery.on_recovery_completed
assign = ConsumerRebalanceListener.on_partitions_assigned

async def on_recovery_completed(self, generation_id=0):
    if holding.is_set():
        return await complete(self, generation_id)
    holding.set()
    revoked = asyncio.Event()
    async def on_revoked(sender, *args, **kwargs):
        revoked.set()
    keep.append(on_revoked)
    self.app.on_partitions_revoked.connect(on_revoked)
    log.warning("held: the recovery of generation %s ends after the next revocation",
                generation_id)
    await asyncio.wait_for(revoked.wait(), 120)
    log.warning("held: the recovery of generation %s ends now", generation_id)
    try:
        return await complete(self, generation_id)
    finally:
        released.set()

async def on_partitions_assigned(self, assigned):
    if holding.is_set() and not released.is_set():
        log.warning("held: an assignment waits for the held recovery's end")
        while not released.is_set():
            await asyncio.sleep(0.02)
    return await assign(self, assigned)

Recovery.on_recovery_completed = on_recovery_completed
ConsumerRebalanceListener.on_partitions_assigned = on_partitions_assigned

from faust.agents.manager import AgentManager
agents_on_rebalance = AgentManager.on_rebalance
slowed = threading.Event()

async def slow_on_rebalance(self, revoked, newly_assigned):
    if released.is_set() and not slowed.is_set():
        slowed.set()
        log.warning("held: a slow loop between the assignment and its pause")
        await asyncio.sleep(1.5)
    return await agents_on_rebalance(self, revoked, newly_assigned)

AgentManager.on_rebalance = slow_on_rebalance
""" + RUN_ACCOUNTING


@pytest.fixture
def settings(services: None) -> Settings:
    s = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    needed = {s.kafka.topic("usage"), s.kafka.topic("dlq"), s.kafka.topic("feedback")}
    asyncio.run(ensure_topics(s, [t for t in catalog(s.kafka) if t.name in needed]))
    return s


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[OwnRedis]:
    own = OwnRedis(tmp_path / "redis").start()
    try:
        yield own
    finally:
        own.stop(signal.SIGKILL)


async def rate(settings: Settings, rids: range, score: float) -> None:
    codec = default_codec()
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for i in rids:
            rid = f"held-{i}"
            event = Feedback(request_id=rid, tenant="held", key_id="k", labels=[], score=score,
                             comment="", model="m", answered_by="m-v1", latency_ms=10,
                             ts_ms=int(time.time() * 1000))
            await producer.send(settings.kafka.topic("feedback"),
                                codec.encode("Feedback", event), key=rid.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def test_a_recovery_ending_in_the_next_rebalance_keeps_every_rating_once(
        settings: Settings, redis: OwnRedis, tmp_path: Path) -> None:
    """A member holds the ratings; a second joins, and its first recovery ends
    after the next rebalance has begun (the first member SIGKILLed, with
    ratings it never read). Once the second holds everything, every request
    counts once, with its latest score."""
    client = aioredis.from_url(redis.url)
    ledger = UsageLedger(settings, client)
    since = int(time.time() * 1000) - 86_400_000
    until = since + 2 * 86_400_000

    async def rated(count: int, mean: float) -> bool:
        days = await ledger.ratings("held", since_ms=since, until_ms=until)
        return bool(days) and (days[-1].count, days[-1].mean) == (count, mean)

    first = Accounting(settings, redis, tmp_path, tmp_path / "home-1")
    second = Accounting(settings, redis, tmp_path / "second", tmp_path / "home-2",
                        script=HELD)
    (tmp_path / "second").mkdir()
    try:
        await rate(settings, range(100), 1.0)
        first.start()
        await eventually(lambda: rated(100, 1.0), 90, first)
        second.start()

        async def joined() -> bool:
            return ("held: the recovery of generation" in second.log()
                    and first.log().count("this member now holds") >= 2)

        await eventually(joined, 60, second)
        # the first member kept the ratings when the second joined, so the next
        # rebalance gives the second a partition it never held
        held_by_first = first.log().rsplit("this member now holds", 1)[-1].splitlines()[0]
        assert "feedback[0]" in held_by_first, held_by_first
        # ratings the first member will never read: each request's latest
        # score, and 50 requests rated for the first time
        assert first.proc is not None
        first.proc.send_signal(signal.SIGSTOP)
        await rate(settings, range(150), 0.5)
        first.proc.kill()  # its session ends; the next rebalance gives all to the second

        async def settled() -> bool:
            return await rated(150, 0.5)

        await eventually(settled, 60, second)
        await asyncio.sleep(2)
        assert await rated(150, 0.5)
    finally:
        for member in (first, second):
            if member.proc is not None and member.proc.poll() is None:
                member.proc.kill()
                member.proc.wait(timeout=10)
        await client.aclose()

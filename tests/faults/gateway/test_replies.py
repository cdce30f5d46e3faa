"""ReplyStream.put: replies reach the client in index order, once each; the
reply-partition lease survives Redis losing its data or going away for a while."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Literal

import redis.asyncio as aioredis

from conveyor.settings import Settings, load_settings
from gateway.health import TaskHealth
from gateway.replies import ReplyLease, ReplyStream
from schemas.records import Reply
from tests.support.services import OwnRedis
from topics.envelope import new_envelope


def reply(index: int, text: str = "",
          kind: Literal["delta", "final", "error"] = "delta") -> Reply:
    return Reply(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                 index=index, kind=kind, text=text, chunk="", finish_reason=None, usage=None,
                 error=None)


def drain(stream: ReplyStream) -> list[int]:
    out = []
    while stream.ready:
        out.append(stream.ready.popleft()["index"])
    return out


def test_in_order_replies_pass_at_once() -> None:
    s = ReplyStream("r1")
    for i in range(3):
        s.put(reply(i))
        assert drain(s) == [i]
    assert s.next_index == 3


def test_early_replies_wait_for_the_ones_before_them() -> None:
    s = ReplyStream("r1")
    s.put(reply(2))
    s.put(reply(1))
    assert drain(s) == []
    s.put(reply(0))
    assert drain(s) == [0, 1, 2]
    assert s.early == {}


def test_repeats_are_dropped() -> None:
    s = ReplyStream("r1")
    s.put(reply(0, "a"))
    s.put(reply(0, "a"))  # already passed
    s.put(reply(2, "c"))
    s.put(reply(2, "c"))  # already waiting
    assert drain(s) == [0]
    s.put(reply(1, "b"))
    assert drain(s) == [1, 2]


def test_a_replayed_stream_is_invisible() -> None:
    # postprocess replayed its log: the same replies arrive a second time
    s = ReplyStream("r1")
    for i in range(4):
        s.put(reply(i))
    for i in range(4):
        s.put(reply(i))
    s.put(reply(4, kind="final"))
    assert drain(s) == [0, 1, 2, 3, 4]


async def test_a_waiting_reader_wakes_up() -> None:
    s = ReplyStream("r1")
    s.put(reply(1))
    s.put(reply(0))
    first = await s.next(time.monotonic() + 5)
    second = await s.next(time.monotonic() + 5)
    assert first is not None and second is not None
    assert (first["index"], second["index"]) == (0, 1)


# -- the reply-partition lease against a Redis of the test's own ---------------

def lease_settings(url: str) -> Settings:
    return load_settings(topic_prefix=f"lt{uuid.uuid4().hex[:6]}", redis_url=url,
                    reply_lease_ttl_s=0.6, retry_backoff_max_s=0.2, reply_partitions=2)


async def wait_state(health: TaskHealth, state: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while health.state != state:
        assert time.monotonic() < deadline, f"still {health.state}: {health.detail}"
        await asyncio.sleep(0.05)


async def test_the_lease_is_taken_again_after_a_flush(own_redis: OwnRedis) -> None:
    settings = lease_settings(own_redis.url)
    redis = aioredis.from_url(settings.redis.url)
    lease = ReplyLease(settings, redis, "gw-a")
    partition = await lease.acquire()
    keeper = asyncio.create_task(lease.keep())
    try:
        own_redis.flush()
        key = f"{settings.kafka.topic_prefix}:reply-lease:{partition}"
        deadline = time.monotonic() + 10
        while await redis.get(key) != b"gw-a":
            assert time.monotonic() < deadline and not keeper.done()
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # several renewals later: still held, still ok
        assert not keeper.done() and lease.health.state == "ok"
        assert await redis.pttl(key) > 0
    finally:
        keeper.cancel()
        await redis.aclose()


async def test_the_lease_outlives_a_redis_outage(own_redis: OwnRedis) -> None:
    settings = lease_settings(own_redis.url)
    redis = aioredis.from_url(settings.redis.url, socket_timeout=1,
                              socket_connect_timeout=1)
    lease = ReplyLease(settings, redis, "gw-b")
    await lease.acquire()
    keeper = asyncio.create_task(lease.keep())
    try:
        own_redis.stop()
        await wait_state(lease.health, "degraded")
        assert "Redis" in lease.health.detail
        own_redis.start()
        await wait_state(lease.health, "ok")
        assert not keeper.done()
    finally:
        keeper.cancel()
        await redis.aclose()


async def test_another_gateway_on_our_partition_is_a_failure_shown(
        own_redis: OwnRedis) -> None:
    settings = lease_settings(own_redis.url)
    redis = aioredis.from_url(settings.redis.url)
    lease = ReplyLease(settings, redis, "gw-c")
    partition = await lease.acquire()
    keeper = asyncio.create_task(lease.keep())
    try:
        await redis.set(f"{settings.kafka.topic_prefix}:reply-lease:{partition}", "gw-other",
                        px=60000)
        await wait_state(lease.health, "failed")
        assert "gw-other" in lease.health.detail and not keeper.done()
    finally:
        keeper.cancel()
        await redis.aclose()

"""The reply router on the real broker: it reads its leased partition through
the shared follower, from the end fixed at its start (a reply written before
``run`` begins is still read), hands each reply to its request's stream in
index order and once, and logs a record that is not a Reply once and goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Literal

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from conveyor.settings import load_settings
from gateway.replies import ReplyLease, ReplyRouter
from schemas.codec import default_codec
from schemas.records import Reply
from topics.admin import ensure_topics
from topics.catalog import REPLIES, catalog
from topics.envelope import new_envelope

codec = default_codec()


def reply(request_id: str, index: int, kind: Literal["delta", "final"] = "delta",
          *also: Reply) -> bytes:
    """A record of ``request_id``'s reply (after the replies ``also``, of others)."""
    return REPLIES.encode(codec, REPLIES.pack([*also, Reply(
        envelope=new_envelope(request_id, reply_gateway="g", reply_partition=0),
        index=index, kind=kind, text=f"t{index}", chunk="", finish_reason=None, usage=None,
        error=None)]))


async def test_replies_reach_their_streams_in_order_once_and_poison_is_skipped(
        services: None, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(topic_prefix=f"rr{uuid.uuid4().hex[:10]}", reply_partitions=1)
    await ensure_topics(settings, [t for t in catalog(settings.kafka)
                                   if t.name == REPLIES.at(settings.kafka)])
    topic = REPLIES.at(settings.kafka)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await producer.start()
    await producer.send_and_wait(topic, reply("r1", 0), partition=0)  # before start: not ours
    router = ReplyRouter(settings, codec, ReplyLease(settings, redis, "gw-test"))
    await router.start()
    assert router.partition == 0 and not router.kafka_unreachable()
    stream, other = router.open("r1"), router.open("other")
    running: asyncio.Task[None] | None = None
    try:
        # written before run() begins: the start was fixed by start()
        for value in [reply("r1", 1), b"\x00not a reply", reply("r1", 0), reply("r1", 0),
                      # one record, two requests' replies: each goes to its stream
                      reply("r1", 2, "final", codec.decode(reply("other", 0), "ReplyBatch")[
                          "replies"][0])]:
            await producer.send_and_wait(topic, value, partition=0)
        with caplog.at_level(logging.WARNING, logger="topics.follow"):
            running = asyncio.create_task(router.run())
            deadline = time.monotonic() + 30
            got = [await stream.next(deadline) for _ in range(3)]
        assert [(r["index"], r["text"]) for r in got if r] == [(0, "t0"), (1, "t1"), (2, "t2")]
        assert not stream.ready and stream.early == {}
        assert [(r["index"], r["text"]) for r in [await other.next(deadline)] if r] == [
            (0, "t0")]
        skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
        assert len(skipped) == 1 and "not a ReplyBatch" in skipped[0], skipped
        while router.health.state != "ok":  # the follower's sight, shown as health
            assert time.monotonic() < deadline, router.health
            await asyncio.sleep(0.05)
        assert not router.kafka_unreachable() and not running.done()
    finally:
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        await router.stop()
        await producer.stop()

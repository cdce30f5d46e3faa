"""Resumable streams, the parts that need no pipeline: event ids, what a client
resumes after, the grace before a dropped stream's generation is cancelled (on
the real Redis), and infer workers keeping a resumed generation alive."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from conveyor.errors import InvalidRequest
from conveyor.settings import load_settings
from gateway import sse
from gateway.answer import Answer
from gateway.cancels import ResumeWatch
from gateway.chat.serving import ChatServing
from gateway.replies import ReplyStream
from gateway.resume import (
    _LOOKUP_WINDOWS_S,
    StreamNotFound,
    locate,
    lookup_windows,
    request_id_of,
    resume_after,
)
from schemas.codec import default_codec
from schemas.records import Reply, Request
from tests.support.gateway_fakes import RecordingProducer, Router, chat_serving
from tests.support.schedule_tasks import full_task
from topics.admin import drop_topics, ensure_topics
from topics.catalog import REQUESTS, catalog
from topics.clients import make_producer
from topics.envelope import new_envelope, now_ms
from topics.lookup import SharedLookup
from workers.infer.gateways import GatewayWatch


def test_an_event_carries_its_id() -> None:
    assert sse.data('{"a":1}', id="r1:3") == b'id: r1:3\ndata: {"a":1}\n\n'
    assert sse.data("x", event="e", id="r:0") == b"event: e\nid: r:0\ndata: x\n\n"


def test_a_stream_id_names_its_request_on_its_own_route_only() -> None:
    assert request_id_of("chatcmpl-abc123", "chat") == "abc123"
    assert request_id_of("cmpl-abc123", "completion") == "abc123"
    assert request_id_of("abc123", "chat") == "abc123"
    for bad, kind in (("cmpl-abc", "chat"), ("chatcmpl-abc", "completion"), ("a/b", "chat"),
                      ("chatcmpl-", "chat")):
        with pytest.raises(StreamNotFound):
            request_id_of(bad, kind)  # type: ignore[arg-type]


def test_what_a_client_resumes_after() -> None:
    assert resume_after("r1", None, None) == -1
    assert resume_after("r1", "r1:4", None) == 4
    assert resume_after("r1", "7", None) == 7
    assert resume_after("r1", None, "2") == 2
    assert resume_after("r1", "r1:9", "2") == 9  # the header is the newer
    for header, query in (("r2:4", None), ("r1:x", None), (None, "-1"), (None, "a")):
        with pytest.raises(InvalidRequest):
            resume_after("r1", header, query)


# -- the stream and its grace, on the real Redis --------------------------------

def reply(index: int, kind: str, chunks: list[dict[str, Any]]) -> Reply:
    return Reply(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                 index=index, kind=kind,  # type: ignore[typeddict-item]
                 text="", chunk="\n".join(json.dumps(c) for c in chunks),
                 finish_reason=None, usage=None, error=None)


def serving(redis: aioredis.Redis, grace_s: float) -> tuple[ChatServing, RecordingProducer]:
    producer = RecordingProducer()
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}", resume_grace_s=grace_s,
                        sse_keepalive_s=5)
    return chat_serving(settings, producer, redis), producer


async def test_events_are_numbered_per_chunk_object(redis: aioredis.Redis) -> None:
    s, _ = serving(redis, 0)
    answer = Answer(ReplyStream("r1"), time.monotonic() + 5,
                    Router(), s.submitter.cancels)  # type: ignore[arg-type]
    answer.stream.put(reply(0, "delta", [{"a": 1}, {"b": 2}]))
    answer.stream.put(reply(1, "final", [{"c": 3}]))
    first = await answer.next()
    assert first is not None
    frames = [f async for f in s.stream(answer, first)]
    # one write a reply, its chunk objects each an event of its own
    assert frames == [b'id: r1:0\ndata: {"a": 1}\n\nid: r1:1\ndata: {"b": 2}\n\n',
                      b'id: r1:2\ndata: {"c": 3}\n\n' + sse.DONE]


async def test_a_dropped_stream_is_cancelled_only_after_the_grace(redis: aioredis.Redis
                                                                   ) -> None:
    s, producer = serving(redis, 0.4)
    answer = Answer(ReplyStream("r1"), time.monotonic() + 5,
                    Router(), s.submitter.cancels)  # type: ignore[arg-type]
    frames = s.stream(answer, reply(0, "delta", [{"a": 1}]))
    await frames.__anext__()
    await frames.aclose()  # the client went away
    await asyncio.sleep(0.2)
    assert producer.sent == []
    await asyncio.sleep(0.5)
    [(topic, value)] = producer.sent
    control = default_codec().decode(value, "Control")
    assert topic.endswith(".control") and control["request_id"] == "r1"
    assert "not resumed" in control["reason"]


async def test_a_stream_resumed_within_the_grace_is_not_cancelled(redis: aioredis.Redis
                                                                   ) -> None:
    s, producer = serving(redis, 0.3)
    watch = ResumeWatch(s.settings, redis)
    answer = Answer(ReplyStream("r1"), time.monotonic() + 5,
                    Router(), s.submitter.cancels)  # type: ignore[arg-type]
    frames = s.stream(answer, reply(0, "delta", [{"a": 1}]))
    await frames.__anext__()
    await frames.aclose()
    reader = "replica-2"
    await watch.renew("r1", reader)  # a replica serves the resumed stream
    try:
        await asyncio.sleep(0.6)
        assert producer.sent == []
        # that reader leaves too: its own grace ends in a cancel, and its watch is gone
        s.submitter.cancels.cancel("r1", "resumed client disconnected", grace_s=0.2, reader=reader)
        await asyncio.sleep(0.5)
        assert len(producer.sent) == 1
        assert await redis.get(watch.key("r1")) is None
    finally:
        await redis.delete(watch.key("r1"))


# -- infer: a resumed generation outlives its gateway -------------------------------

@dataclass
class Run:
    request_id: str
    task: dict[str, Any]
    cancelled: bool = False


async def test_workers_keep_a_watched_generation_of_a_gone_gateway(redis: aioredis.Redis
                                                                   ) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}", reply_lease_ttl_s=0.05)
    runs = [Run(rid, {"envelope": new_envelope(rid, reply_gateway="dead", reply_partition=3)})
            for rid in ("kept", "orphan")]
    watch = ResumeWatch(settings.replace(reply_lease_ttl_s=15.0), redis)
    await watch.renew("kept", "replica-2")
    try:
        gateways = GatewayWatch(settings, redis)
        await gateways.check(runs)  # type: ignore[arg-type]
        await asyncio.sleep(0.1)  # the lease has been gone a whole period
        await gateways.check(runs)  # type: ignore[arg-type]
        assert [r.cancelled for r in runs] == [False, True]
    finally:
        await redis.delete(watch.key("kept"))


# -- where the log is searched for a request ------------------------------------

DAY_MS = 24 * 3600 * 1000


def test_the_log_is_searched_first_where_the_id_was_made() -> None:
    settings = load_settings(clock_skew_ms=2000)
    now = now_ms()
    rid = f"{now - 2 * DAY_MS:012x}" + "0" * 20  # made two days ago
    windows = lookup_windows(settings, rid, now)
    since, until = windows[0]
    assert since == now - 2 * DAY_MS - 2000 and until is not None
    assert until - since < 5 * 60 * 1000  # a few minutes of the partition, not two days
    assert [w for w, _ in windows[1:]] == [now - s * 1000 - 2000 for s in _LOOKUP_WINDOWS_S]


def test_a_random_id_is_searched_in_the_recent_windows_only() -> None:
    settings = load_settings()
    now = now_ms()
    # a random id whose leading digits read as a time far from now (any id not
    # made by new_request_id; one in about 10^5 random ones reads as a recent time)
    found = [lookup_windows(settings, "f" + uuid.uuid4().hex[1:], now) for _ in range(200)]
    assert all(len(w) == len(_LOOKUP_WINDOWS_S) for w in found)


async def test_a_job_s_request_is_found_from_when_its_job_was_made(services: None) -> None:
    """A job's request id (a background response's id) says no time: past the
    recent windows it is found from its job's creation, which the caller knows."""
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    requests = settings.kafka.topic("requests")
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name == requests])
    made = now_ms() - 2 * 3600 * 1000  # before every recent window
    rid = "resp_" + uuid.uuid4().hex
    task = full_task(rid)
    envelope = new_envelope(rid, reply_gateway="", reply_partition=-1, tenant="acme",
                            job_id=rid, deadline_ms=made + 60_000)
    producer = make_producer(settings.kafka)
    await producer.start()
    lookup = SharedLookup(settings)
    try:
        await producer.send_and_wait(requests, REQUESTS.encode(default_codec(), Request(
            envelope=envelope, generation=task["generation"])), key=rid.encode(),
            timestamp_ms=made)
        assert await locate(lookup, rid, of_job=True) is None
        found = await locate(lookup, rid, of_job=True, since_ms=made)
        assert found is not None and found.tenant == "acme"
        assert found.generation["messages"][0]["content"] == \
            task["generation"]["messages"][0]["content"]
        assert await locate(lookup, rid, since_ms=made) is None  # not a stream's
    finally:
        await lookup.close()
        await producer.stop()
        drop_topics(settings.kafka.bootstrap, settings.kafka.topic_prefix)

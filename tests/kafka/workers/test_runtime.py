"""LayerRuntime on the real Kafka, with a scripted layer: what cannot be
produced goes to the DLQ with an error reply and the runtime goes on; events
of different requests are handled concurrently, of one request in order;
commits stay below the lowest unfinished event; cancelled requests' events
are dropped."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from conveyor.settings import Settings, load_settings
from schemas.codec import EventType, default_codec
from schemas.records import Control, Request
from tests.support.factories import chunk, request
from topics.admin import ensure_topics
from topics.catalog import REQUESTS, TOKENS, catalog, topic_named
from topics.envelope import now_ms
from workers.cancels import CancelList
from workers.inflight import PartitionBook
from workers.layer import Layer
from workers.outputs import Output
from workers.runtime import LayerRuntime

MAX_EVENT = 64 * 1024
codec = default_codec()


class ScriptedLayer(Layer):
    """Requests in, the same request out on ``prepared``, as each request id says:
    ``big*`` gives an output larger than a topic takes, ``slow*`` waits for
    ``release``, ``bad*`` an output its schema cannot encode."""

    name = "scripted"
    source = REQUESTS

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.release = asyncio.Event()
        self.handled: list[str] = []

    async def handle(self, event: Request, record: Any) -> list[Output]:
        rid = event["envelope"]["request_id"]
        if rid.startswith("slow"):
            await self.release.wait()
        self.handled.append(rid)
        if rid.startswith("big"):
            event["generation"]["prompt"] = "x" * (MAX_EVENT * 2)
        record_out: Any = event
        if rid.startswith("bad"):
            record_out = {"envelope": event["envelope"]}
        return [Output(self.settings.kafka.topic("prepared"), "Request", record_out, key=rid)]


class CancellingLayer(ScriptedLayer):
    cancellable = True

    def cancel(self, request_id: str) -> None:
        self.handled.append(f"cancel:{request_id}")


@pytest.fixture
async def settings(services: None) -> Settings:
    s = load_settings(topic_prefix=f"rt{uuid.uuid4().hex[:10]}", max_event_bytes=MAX_EVENT)
    await ensure_topics(s, catalog(s.kafka))
    return s


@pytest.fixture
async def producer(settings: Settings) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await p.start()
    yield p
    await p.stop()


@contextlib.asynccontextmanager
async def running(settings: Settings, layer: ScriptedLayer, **options: Any
                  ) -> AsyncIterator[LayerRuntime]:
    runtime = LayerRuntime(settings, layer, **options)
    task = asyncio.create_task(runtime.run())
    try:
        yield runtime
    finally:
        runtime.stop()
        layer.release.set()
        await asyncio.wait_for(task, 60)


async def send(producer: AIOKafkaProducer, settings: Settings, rid: str, partition: int = 0,
               prompt: str = "hello") -> int:
    event = request(request_id=rid, kind="completion", prompt=prompt)
    meta = await producer.send_and_wait(settings.kafka.topic("requests"),
                                        codec.encode("Request", event), key=rid.encode(),
                                        partition=partition)
    return int(meta.offset)


def unpacked(settings: Settings, topic: str, value: bytes, event_type: EventType) -> list[Any]:
    """A record's events: itself, or those of a record of many (conveyor.replies)."""
    typed = topic_named(settings.kafka, settings.kafka.topic(topic))
    if typed is not None and typed.batch is not None:
        return typed.unpack(codec, value)
    return [codec.decode(value, event_type)]


async def read_until(settings: Settings, topic: str, event_type: EventType,
                     done: Callable[[list[Any]], bool], within: float = 60.0) -> list[Any]:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    seen: list[Any] = []
    try:
        consumer.subscribe([settings.kafka.topic(topic)])
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not done(seen):
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                seen.extend(e for r in records for e in unpacked(settings, topic, r.value,
                                                                  event_type))
    finally:
        await consumer.stop()
    assert done(seen), f"gave up on {topic}: {seen!r:.2000}"
    return seen


async def committed(settings: Settings, layer: str, tp: TopicPartition) -> int | None:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap,
                                group_id=settings.kafka.group(layer), enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.committed(tp)
    finally:
        await consumer.stop()


async def committed_reaches(settings: Settings, tp: TopicPartition, offset: int) -> bool:
    for _ in range(100):
        if await committed(settings, "scripted", tp) == offset:
            return True
        await asyncio.sleep(0.3)
    return False


def ids(events: list[Any]) -> list[str]:
    return [e["envelope"]["request_id"] for e in events]


def test_the_lowest_unfinished_offset_bounds_the_commit() -> None:
    part = PartitionBook()
    for offset in (10, 11, 12, 13):
        part.take(offset)
    part.finish(12)
    part.finish(13)
    assert part.low() == 10 and part.pending == 2
    part.finish(10)
    assert part.low() == 11
    part.finish(11)
    assert part.low() == 14 and part.pending == 0


async def test_an_output_too_large_goes_to_the_dlq_with_a_413_and_the_runtime_goes_on(
        settings: Settings, producer: AIOKafkaProducer) -> None:
    layer = ScriptedLayer(settings)
    async with running(settings, layer) as runtime:
        big_offset = await send(producer, settings, "big-1")
        await send(producer, settings, "bad-1")
        await send(producer, settings, "after-1")
        prepared = await read_until(settings, "prepared", "Request",
                                    lambda seen: "after-1" in ids(seen))
        assert ids(prepared) == ["after-1"]
        replies = await read_until(settings, "replies", "Reply",
                                   lambda seen: len(seen) >= 2)
        errors = {r["envelope"]["request_id"]: r["error"] for r in replies}
        assert errors["big-1"]["status"] == 413
        assert errors["big-1"]["code"] == "request_too_large"
        assert errors["bad-1"]["status"] == 500
        letters = await read_until(settings, "dlq", "DeadLetter", lambda seen: len(seen) >= 2)
        big = next(x for x in letters if x["key"] == b"big-1")
        assert big["offset"] == big_offset and big["layer"] == "scripted"
        assert codec.decode(big["value"], "Request")["envelope"]["request_id"] == "big-1"
        assert "MessageSizeTooLarge" in big["error"]
        assert any(x["key"] == b"bad-1" and "SchemaError" in x["error"] for x in letters)
        tp = TopicPartition(settings.kafka.topic("requests"), 0)
        assert await committed_reaches(settings, tp, 3)
        assert not runtime._stopping.is_set()


async def test_a_slow_request_does_not_hold_up_the_others_nor_the_commit_past_it(
        settings: Settings, producer: AIOKafkaProducer) -> None:
    layer = ScriptedLayer(settings)
    tp = TopicPartition(settings.kafka.topic("requests"), 0)
    async with running(settings, layer):
        slow = await send(producer, settings, "slow-1")
        await send(producer, settings, "fast-1")
        await send(producer, settings, "fast-2")
        prepared = await read_until(settings, "prepared", "Request",
                                    lambda seen: {"fast-1", "fast-2"} <= set(ids(seen)))
        assert "slow-1" not in ids(prepared)
        await asyncio.sleep(1.0)  # commits happen every 100 ms; none may pass slow-1
        assert await committed(settings, "scripted", tp) in (None, slow)
        layer.release.set()
        await read_until(settings, "prepared", "Request", lambda seen: "slow-1" in ids(seen))
        assert await committed_reaches(settings, tp, 3)


async def test_events_of_one_request_keep_their_order(
        settings: Settings, producer: AIOKafkaProducer) -> None:
    layer = ScriptedLayer(settings)
    async with running(settings, layer):
        await send(producer, settings, "slow-a", prompt="first")
        await send(producer, settings, "slow-a", prompt="second")
        await send(producer, settings, "other")
        await read_until(settings, "prepared", "Request", lambda seen: "other" in ids(seen))
        layer.release.set()
        prepared = await read_until(settings, "prepared", "Request",
                                    lambda seen: ids(seen).count("slow-a") == 2)
    prompts = [p["generation"]["prompt"] for p in prepared if ids([p]) == ["slow-a"]]
    assert prompts == ["first", "second"]


async def test_a_cancelled_request_is_dropped(
        settings: Settings, producer: AIOKafkaProducer) -> None:
    cancel = Control(request_id="gone", action="cancel", reason="client left", ts_ms=now_ms())
    await producer.send_and_wait(settings.kafka.topic("control"), codec.encode("Control", cancel),
                                 key=b"gone")
    cancels = CancelList(settings)
    follower = asyncio.create_task(cancels.run())
    try:
        for _ in range(300):
            if "gone" in cancels:
                break
            await asyncio.sleep(0.1)
        layer = CancellingLayer(settings)
        async with running(settings, layer, cancels=cancels):
            await send(producer, settings, "gone")
            await send(producer, settings, "kept")
            prepared = await read_until(settings, "prepared", "Request",
                                        lambda seen: "kept" in ids(seen))
            assert ids(prepared) == ["kept"]
            assert "gone" not in layer.handled
    finally:
        follower.cancel()


class CountingAssignments(ScriptedLayer):
    """Keeps the assignment the runtime reports after each rebalance."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.assignment: list[TopicPartition] = []

    def assigned(self, partitions: list[TopicPartition]) -> None:
        self.assignment = sorted(partitions)


async def test_an_assignment_aware_layer_hears_its_whole_assignment_after_each_rebalance(
        settings: Settings) -> None:
    """Two members of one group: each hears what it holds, and together all of it
    (what the schedule layer's part of the batch share is computed from)."""
    first, second = CountingAssignments(settings), CountingAssignments(settings)
    every = {TopicPartition(settings.kafka.topic("requests"), p)
             for p in range(settings.kafka.pipeline_partitions)}

    async def until(check: Callable[[], bool]) -> None:
        for _ in range(200):
            if check():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{first.assignment} / {second.assignment}")

    async with running(settings, first):
        await until(lambda: set(first.assignment) == every)
        async with running(settings, second):
            await until(lambda: bool(first.assignment) and bool(second.assignment)
                        and set(first.assignment) | set(second.assignment) == every
                        and not set(first.assignment) & set(second.assignment))
        await until(lambda: set(first.assignment) == every)  # the second left


class ChunkLayer(ScriptedLayer):
    """Reads conveyor.tokens: a cancel out for each chunk, a bug on ``boom*``'s."""

    source = TOKENS  # type: ignore[assignment]

    async def handle(self, event: Any, record: Any) -> list[Output]:
        rid = event["envelope"]["request_id"]
        if rid.startswith("boom"):
            raise RuntimeError("a bug on one request's chunk")
        self.handled.append(rid)
        cancel = Control(request_id=rid, action="cancel", reason="seen", ts_ms=1)
        return [Output(self.settings.kafka.topic("control"), "Control", cancel, key=rid)]


async def test_a_record_of_many_requests_fails_only_the_request_whose_chunk_fails(
        settings: Settings, producer: AIOKafkaProducer) -> None:
    """One bad chunk in a tokens record: its request gets a 500 reply and the record
    a dead letter, the other requests' chunks are handled; a record that does not
    decode is dead-lettered; the runtime goes on and commits past both."""
    layer = ChunkLayer(settings)
    topic = TOKENS.at(settings.kafka)
    chunks = [chunk("ok-1", 0, "a"), chunk("boom-1", 0, "b"), chunk("ok-2", 0, "c")]
    async with running(settings, layer):
        await producer.send_and_wait(topic, b"junk", partition=0)
        await producer.send_and_wait(topic, TOKENS.encode(codec, TOKENS.pack(chunks)),
                                     partition=0)
        controls = await read_until(settings, "control", "Control",
                                    lambda seen: len(seen) >= 2)
        assert [c["request_id"] for c in controls] == ["ok-1", "ok-2"]
        [reply] = await read_until(settings, "replies", "Reply", lambda seen: len(seen) >= 1)
        assert reply["envelope"]["request_id"] == "boom-1" and reply["error"]["status"] == 500
        letters = await read_until(settings, "dlq", "DeadLetter", lambda seen: len(seen) >= 2)
        assert sorted(x["offset"] for x in letters) == [0, 1]
        assert await committed_reaches(settings, TopicPartition(topic, 0), 2)

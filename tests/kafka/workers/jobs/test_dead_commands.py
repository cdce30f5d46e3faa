"""The jobs layer's follower of the DLQ on the real broker, on its layer
runtime: a dead create command of a batch still validating fails it, and what
the follower cannot use (a record that is not a DeadLetter, a letter whose
handling fails) is logged and passed over: never published into the DLQ it
reads, which would then feed itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import DeadLetter, JobResult, JobStatus
from topics.admin import ensure_topics
from topics.catalog import DLQ, JOB_STATUS, JOBS, RESULTS, catalog
from topics.clients import make_producer
from topics.envelope import now_ms
from workers.jobs.dead_commands import DEAD_COMMANDS_GROUP, DeadCommands, DeadLetters
from workers.outputs import Sender
from workers.runtime import LayerRuntime

codec = default_codec()


@pytest.fixture
async def settings(services: None) -> Settings:
    s = load_settings(topic_prefix=f"dc{uuid.uuid4().hex[:10]}", retry_backoff_max_s=0.5)
    wanted = {t.at(s.kafka) for t in (DLQ, JOB_STATUS, JOBS, RESULTS)}
    await ensure_topics(s, [t for t in catalog(s.kafka) if t.name in wanted])
    return s


@pytest.fixture
async def sender(settings: Settings) -> AsyncIterator[Sender]:
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        yield Sender(settings, producer, codec)
    finally:
        await producer.stop()


def letter(settings: Settings, job_id: str, value: bytes) -> bytes:
    return codec.encode("DeadLetter", DeadLetter(
        layer="jobs", topic=JOBS.at(settings.kafka), partition=0, offset=0, key=job_id.encode(),
        value=value, error="SchemaError: not an Avro value", ts_ms=now_ms()))


async def write(settings: Settings, records: list[tuple[str, bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await producer.start()
    try:
        for topic, key, value in records:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def validating(settings: Settings, job_id: str) -> tuple[str, bytes, bytes]:
    status = JobStatus(job_id=job_id, kind="batch", tenant="acme", version=0, ts_ms=now_ms(),
                       object=json.dumps({"id": job_id, "status": "validating"}))
    return JOB_STATUS.at(settings.kafka), job_id.encode(), codec.encode("JobStatus", status)


async def read_all(settings: Settings, topic: str, partitions: int = 1) -> list[bytes]:
    """Every value of ``topic``, partition after partition."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        values: list[bytes] = []
        for tp in tps:
            while await consumer.position(tp) < ends[tp]:
                for records in (await consumer.getmany(tp, timeout_ms=300)).values():
                    values += [r.value for r in records if r.value is not None]
        return values
    finally:
        await consumer.stop()


async def job_events(settings: Settings) -> list[tuple[str, str]]:
    """(job id, event) of every job result written."""
    values = await read_all(settings, RESULTS.at(settings.kafka),
                            settings.kafka.pipeline_partitions)
    results: list[JobResult] = [codec.decode(v, "JobResult") for v in values]
    return [(r["job_id"], r["event"]) for r in results]


async def committed(settings: Settings) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap,
                                group_id=settings.kafka.group(DEAD_COMMANDS_GROUP),
                                enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.committed(TopicPartition(DLQ.at(settings.kafka), 0)) or -1
    finally:
        await consumer.stop()


@contextlib.asynccontextmanager
async def following(run: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until_committed(settings: Settings, offset: int, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while await committed(settings) < offset:
        assert time.monotonic() < deadline, f"the DLQ was not committed to {offset}"
        await asyncio.sleep(0.3)


async def test_poison_in_the_dlq_is_passed_over_and_not_published_again(
        settings: Settings, sender: Sender) -> None:
    dlq = DLQ.at(settings.kafka)
    await write(settings, [validating(settings, "batch_a"),
                           (dlq, b"batch_p", b"\x00not a dead letter"),
                           (dlq, b"batch_a", letter(settings, "batch_a", b"\x00junk"))])
    async with following(DeadCommands(settings, sender).run):
        await until_committed(settings, 2)
    # the poison record stays where it was, alone: nothing was added to the DLQ
    values = await read_all(settings, dlq)
    assert len(values) == 2 and values[0] == b"\x00not a dead letter", values
    assert await job_events(settings) == [("batch_a", "invalid")]


class FailingLetters(DeadLetters):
    """The layer with a bug on one job's letters."""

    async def state(self, letter: DeadLetter, job_id: str) -> JobStatus | None:
        if job_id == "batch_bug":
            raise RuntimeError("a bug in reading the job's state")
        return await super().state(letter, job_id)


async def test_a_letter_that_fails_is_passed_over_and_not_published_again(
        settings: Settings, sender: Sender) -> None:
    dlq = DLQ.at(settings.kafka)
    await write(settings, [validating(settings, "batch_ok"),
                           (dlq, b"batch_bug", letter(settings, "batch_bug", b"\x00x")),
                           (dlq, b"batch_ok", letter(settings, "batch_ok", b"\x00y"))])
    runtime = LayerRuntime(settings, FailingLetters(settings, codec), codec=codec,
                           producer=sender.producer)
    async with following(runtime.run):
        await until_committed(settings, 2)
    assert len(await read_all(settings, dlq)) == 2
    assert await job_events(settings) == [("batch_ok", "invalid")]


async def write_at(settings: Settings, topic: str, key: bytes, value: bytes,
                   timestamp_ms: int | None = None) -> tuple[int, int]:
    """One record stamped ``timestamp_ms`` (now when None): (partition, offset)."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, value, key=key, timestamp_ms=timestamp_ms)
        return meta.partition, meta.offset
    finally:
        await producer.stop()


@pytest.mark.parametrize("held_s", [20, 3 * 3600])
async def test_a_status_stamped_long_before_its_command_is_still_found(
        settings: Settings, sender: Sender, held_s: int) -> None:
    """A record's time is when its producer was handed it: a status held through
    a broker's restart (NotLeaderForPartition for 20 s) lands stamped well before
    the command sent after its acknowledgement, and one from a clock far off
    further still. The follower still finds the job validating and fails it."""
    job_id = f"batch_held_{held_s}"
    topic, key, value = validating(settings, job_id)
    await write_at(settings, topic, key, value, now_ms() - held_s * 1000)
    partition, offset = await write_at(settings, JOBS.at(settings.kafka), key, b"\x00junk")
    dead = codec.decode(letter(settings, job_id, b"\x00junk"), "DeadLetter")
    dead["partition"], dead["offset"] = partition, offset
    await write(settings, [(DLQ.at(settings.kafka), key, codec.encode("DeadLetter", dead))])
    async with following(DeadCommands(settings, sender).run):
        await until_committed(settings, 1)
    assert await job_events(settings) == [(job_id, "invalid")]

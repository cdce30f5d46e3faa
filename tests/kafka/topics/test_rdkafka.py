"""The librdkafka producer (topics/rdkafka.py) on the real broker: what the
rest of Conveyor relies on from a producer, as the aiokafka one gives it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner

from conveyor.errors import TransientBrokerError
from conveyor.settings import Settings
from topics.clients import EventTooLarge, make_consumer, make_producer
from topics.rdkafka import RdProducer, RecordMeta

BOOTSTRAP = "127.0.0.1:9092"
SETTINGS = Settings(kafka_producer="librdkafka", max_event_bytes=64 * 1024)


@pytest.fixture
async def topic() -> AsyncIterator[str]:
    name = f"t{uuid.uuid4().hex[:10]}.rd"
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 4, 1)])
        yield name
        await admin.delete_topics([name])
    finally:
        await admin.close()


async def test_records_land_where_aiokafka_would_put_them_with_their_headers(
        topic: str) -> None:
    producer = make_producer(SETTINGS)
    assert isinstance(producer, RdProducer)
    await producer.start()
    try:
        assert await producer.partitions_for(topic) == {0, 1, 2, 3}
        futures = [await producer.send(topic, f"v{i}".encode(), key=f"req-{i}".encode(),
                                       headers=[("traceparent", b"00-x")]) for i in range(40)]
        metas = await asyncio.gather(*futures)
        explicit = await producer.send_and_wait(topic, b"here", key=b"req-0", partition=2)
    finally:
        await producer.stop()
    partitioner = DefaultPartitioner()
    for i, meta in enumerate(metas):
        assert isinstance(meta, RecordMeta) and meta.topic == topic
        assert meta.partition == partitioner(f"req-{i}".encode(), [0, 1, 2, 3], [0, 1, 2, 3])
    assert explicit.partition == 2
    consumer = make_consumer(SETTINGS)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(4)]
        consumer.assign(tps)
        read = []
        # a CI run with every tier in parallel once read nothing here in 20 s
        # (quiet, it takes under a second): the bound is a minute, and says
        # what it had read
        deadline = asyncio.get_running_loop().time() + 60
        while len(read) < 41:
            assert asyncio.get_running_loop().time() < deadline, (
                f"read {len(read)} of 41: {[(r.partition, r.offset) for r in read]}")
            for records in (await consumer.getmany(timeout_ms=500)).values():
                read += records
    finally:
        await consumer.stop()
    assert sorted(r.value for r in read) == sorted([f"v{i}".encode() for i in range(40)]
                                                   + [b"here"])
    assert all(r.headers == (("traceparent", b"00-x"),) for r in read if r.value != b"here")


async def test_an_event_too_large_is_refused_for_good(topic: str) -> None:
    producer = make_producer(SETTINGS)
    await producer.start()
    try:
        with pytest.raises(EventTooLarge):
            await producer.send_and_wait(topic, b"x" * (2 * SETTINGS.max_event_bytes))
    finally:
        await producer.stop()


async def test_no_broker_fails_the_start_as_passing_trouble() -> None:
    producer = make_producer(Settings(kafka_producer="librdkafka",
                                      kafka_bootstrap="127.0.0.1:1"))
    assert isinstance(producer, RdProducer)
    producer.start_timeout_s = 1.0
    with pytest.raises(TransientBrokerError):
        await producer.start()


async def test_partitions_of_a_topic_created_a_moment_later_are_waited_for() -> None:
    """A topic the broker does not know yet (created just now, its metadata not
    yet everywhere) is asked about again, as aiokafka's producer does; one that
    never comes is passing trouble once the wait is over."""
    name = f"t{uuid.uuid4().hex[:10]}.rd-late"
    producer = make_producer(SETTINGS)
    assert isinstance(producer, RdProducer)
    await producer.start()
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    try:
        asking = asyncio.ensure_future(producer.partitions_for(name))
        await asyncio.sleep(0.5)
        assert not asking.done(), asking
        await admin.create_topics([NewTopic(name, 2, 1)])
        assert await asyncio.wait_for(asking, 20) == {0, 1}
        producer.start_timeout_s = 1.0
        with pytest.raises(TransientBrokerError):
            await producer.partitions_for(f"{name}-never")
    finally:
        await admin.delete_topics([name])
        await admin.close()
        await producer.stop()

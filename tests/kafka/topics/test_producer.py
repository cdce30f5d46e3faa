"""A real idempotent producer whose sequence has a hole, on the real broker.

aiokafka 0.14 leaves such a hole when it expires a batch of a partition with
no leader (a broker restart that outlasts ``request_timeout_ms``): the batch
took its sequence numbers and was never written. The broker then refuses
every later batch of the partition with OutOfOrderSequenceNumber; Conveyor's
producer (topics/producer.py) starts afresh and delivers each record once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import OutOfOrderSequenceNumber

from conveyor.settings import Settings, load_settings
from topics.clients import make_consumer, make_producer

BOOTSTRAP = "127.0.0.1:9092"


@pytest.fixture
async def topic() -> AsyncIterator[str]:
    name = f"t{uuid.uuid4().hex[:10]}.sequence"
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1)])
        yield name
        await admin.delete_topics([name])
    finally:
        await admin.close()


def punch_hole(producer: AIOKafkaProducer, topic: str) -> None:
    """Take sequence numbers no batch will carry, as an expired batch does."""
    producer._txn_manager.increment_sequence_number(TopicPartition(topic, 0), 3)


async def read_back(settings: Settings, topic: str, count: int) -> list[bytes]:
    consumer = make_consumer(settings.kafka)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        values: list[bytes] = []
        async with asyncio.timeout(20):
            while len(values) < count:
                batch = await consumer.getmany(tp, timeout_ms=500)
                values += [r.value for r in batch.get(tp, [])]
        await asyncio.sleep(0.5)  # nothing more than expected
        values += [r.value for r in (await consumer.getmany(tp, timeout_ms=500)).get(tp, [])]
        return values
    finally:
        await consumer.stop()


async def test_aiokafkas_own_producer_is_refused_for_good_after_a_hole(topic: str) -> None:
    """The premise, on the real broker (what the unit tests' fake does)."""
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"m0", partition=0)
        punch_hole(producer, topic)
        for value in (b"m1", b"m2"):
            with pytest.raises(OutOfOrderSequenceNumber):
                await producer.send_and_wait(topic, value, partition=0)
    finally:
        await producer.stop()


async def test_conveyors_producer_delivers_each_record_once_after_a_hole(topic: str) -> None:
    settings = load_settings(kafka_bootstrap=BOOTSTRAP)
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"m0", partition=0)
        punch_hole(producer._current, topic)
        acks = [await producer.send(topic, v, partition=0) for v in (b"m1", b"m2", b"m3")]
        await asyncio.gather(*acks)
        await producer.send_and_wait(topic, b"m4", partition=0)
        assert producer.renewals == 1
    finally:
        await producer.stop()
    assert sorted(await read_back(settings, topic, 5)) == [b"m0", b"m1", b"m2", b"m3", b"m4"]

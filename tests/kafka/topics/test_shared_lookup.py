"""The process's keyed lookup on the real broker: many tasks at once each get
their own key's records, whichever reader served them, a reader kept for
later calls fetches nothing while it waits, and ``find`` gives a topic's
events decoded, passing over what does not decode."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import Control
from tests.support.pipeline import drop_topics
from topics.admin import ensure_topics
from topics.catalog import CONTROL, catalog
from topics.clients import make_producer
from topics.envelope import now_ms
from topics.lookup import KeyLookup, SharedLookup, key_partition

PARTITIONS = 4
KEYS = 24
PER_KEY = 3


@dataclass
class Written:
    settings: Settings
    topics: list[str]
    since_ms: int
    # (topic, key) -> the values written under it, in order, with their offsets
    values: dict[tuple[str, str], list[tuple[int, bytes]]]


@pytest.fixture(scope="module")
async def written(services: None) -> AsyncIterator[Written]:
    """Two topics of ``PARTITIONS`` partitions, ``PER_KEY`` records for each of
    ``KEYS`` keys in each, the keys' records interleaved."""
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    topics = [settings.kafka.topic("one"), settings.kafka.topic("two")]
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in topics])
    finally:
        await admin.close()
    since = now_ms() - 1000
    producer = make_producer(settings.kafka)
    await producer.start()
    values: dict[tuple[str, str], list[tuple[int, bytes]]] = {}
    try:
        for round_ in range(PER_KEY):
            for topic in topics:
                for k in range(KEYS):
                    key, value = f"key-{k}", f"{topic}/{k}/{round_}".encode()
                    meta = await producer.send_and_wait(topic, value, key=key.encode())
                    assert meta.partition == key_partition(key.encode(), PARTITIONS)
                    values.setdefault((topic, key), []).append((meta.offset, value))
    finally:
        await producer.stop()
    try:
        yield Written(settings, topics, since, values)
    finally:
        await asyncio.to_thread(drop_topics, settings.kafka.bootstrap, settings.kafka.topic_prefix)


async def test_concurrent_finds_from_many_tasks_get_their_own_records(written: Written
                                                                      ) -> None:
    lookup = SharedLookup(written.settings, readers=3, timeout_s=30)
    asks = [(topic, f"key-{k}") for _ in range(2) for topic in written.topics
            for k in range(KEYS)]
    try:
        found = await asyncio.gather(*(lookup.records(topic, key, written.since_ms)
                                       for topic, key in asks))
        for (topic, key), records in zip(asks, found, strict=True):
            assert [r.value for r in records] == [v for _, v in written.values[topic, key]]
            assert {r.key for r in records} == {key.encode()}
            assert {r.partition for r in records} == {key_partition(key.encode(), PARTITIONS)}
        assert lookup.started <= 3 and lookup.discarded == 0
    finally:
        await lookup.close()


async def test_at_and_first_share_the_readers_too(written: Written) -> None:
    lookup = SharedLookup(written.settings, readers=2, timeout_s=30)
    topic = written.topics[0]
    try:
        async def one(k: int) -> None:
            key = f"key-{k}"
            (offset, value), *_ = written.values[topic, key]
            partition = key_partition(key.encode(), PARTITIONS)
            record = await lookup.at(topic, partition, offset)
            assert record is not None and record.value == value
            [first] = await lookup.records(topic, key, written.since_ms, first=True)
            assert first.value == value

        await asyncio.gather(*(one(k) for k in range(KEYS)))
        assert await lookup.at(topic, 0, 10_000) is None
        assert await lookup.records(topic, "key-0", now_ms() + 60_000) == []
    finally:
        await lookup.close()


async def test_a_kept_reader_fetches_nothing_between_calls(written: Written) -> None:
    """A reader left fetching at a partition's end polls the broker for ever, and
    the next call's offset requests wait behind that poll on its connection."""
    topic = written.topics[1]
    async with KeyLookup(written.settings, timeout_s=30) as lookup:
        await lookup.find(topic, "key-1", written.since_ms)
        consumer = lookup._consumer
        assert consumer.assignment() and consumer.paused() == consumer.assignment()
        (offset, _), *_ = written.values[topic, "key-2"]
        await lookup.at(topic, key_partition(b"key-2", PARTITIONS), offset)
        assert consumer.paused() == consumer.assignment()
        assert await lookup.find(topic, "key-3", now_ms() + 60_000) == []
        assert consumer.paused() == consumer.assignment()


async def test_find_gives_the_topics_events_and_passes_over_poison(services: None) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    control = CONTROL.at(settings.kafka)
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name == control])
    codec = default_codec()
    events = [Control(request_id="r1", action="cancel", reason=str(n), ts_ms=n) for n in (1, 2)]
    since = now_ms() - 1000
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for value in (CONTROL.encode(codec, events[0]), b"junk", CONTROL.encode(codec, events[1])):
            await producer.send_and_wait(CONTROL.at(settings.kafka), value, key=b"r1")
    finally:
        await producer.stop()
    lookup = SharedLookup(settings, timeout_s=30)
    try:
        found = await lookup.find(CONTROL, "r1", since)
        assert [event for _, event in found] == events
        assert [record.offset for record, _ in found] == [0, 2]
    finally:
        await lookup.close()
        await asyncio.to_thread(drop_topics, settings.kafka.bootstrap, settings.kafka.topic_prefix)


async def test_a_reader_knows_a_topic_s_leaders_before_it_asks_for_offsets(
        written: Written) -> None:
    """aiokafka learns an untracked topic's leaders only from a failed offset
    request, then waits its retry backoff: ``track`` loads them first (through
    the client's private ``_topics`` and ``set_topics``, pinned here)."""
    async with KeyLookup(written.settings) as look:
        client = look._consumer._client
        tp = TopicPartition(written.topics[0], 0)
        assert written.topics[0] not in client._topics
        await look.track(written.topics[0])
        assert written.topics[0] in client._topics
        assert client.cluster.leader_for_partition(tp) is not None
        await look.track(written.topics[1])  # a second topic keeps the first
        assert set(written.topics) <= client._topics


async def test_the_last_records_of_each_partition_are_what_just_came(
        written: Written) -> None:
    topic = written.topics[1]
    async with KeyLookup(written.settings) as look:
        last = await look.last(topic, 2)
        everything = await look.last(topic, 10_000)  # more than a partition holds
    per_partition: dict[int, list[int]] = {}
    for r in everything:
        per_partition.setdefault(r.partition, []).append(r.offset)
    assert sorted(per_partition) == list(range(PARTITIONS))
    assert sum(len(o) for o in per_partition.values()) == KEYS * PER_KEY
    assert sorted((r.partition, r.offset) for r in last) == sorted(
        (p, o) for p, offsets in per_partition.items() for o in offsets[-2:])
    shared = SharedLookup(written.settings, readers=1)
    try:
        assert sorted((r.partition, r.offset) for r in await shared.last(topic, 2)) == \
            sorted((r.partition, r.offset) for r in last)
    finally:
        await shared.close()

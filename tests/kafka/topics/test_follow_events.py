"""A follower decodes as its typed topic's event type: poison is logged and
skipped, ``keep`` chooses what is decoded, and a batch is handed on even when
nothing of it was kept."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import Control
from tests.support.topics import create_topic
from topics.admin import ensure_topics
from topics.catalog import CONTROL, catalog
from topics.clients import make_producer
from topics.follow import follow


async def test_events_skip_poison_and_keep_what_is_asked(
        services: None, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    control = CONTROL.at(settings.kafka)
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name == control])
    codec = default_codec()
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for value, key in [(codec.encode("Control", Control(request_id="a", action="cancel",
                                                            ts_ms=1)), b"a"),
                           (b"not an event", b"b"),
                           (codec.encode("Control", Control(request_id="c", action="cancel",
                                                            ts_ms=2)), b"c")]:
            await producer.send_and_wait(CONTROL.at(settings.kafka), value, key=key)
    finally:
        await producer.stop()

    async def read(**kw: Any) -> list[str]:
        follower = follow(settings, CONTROL, 0, "beginning")
        seen: list[str] = []
        async for batch in follower.events(codec, **kw):
            seen += [event["request_id"] for _, event in batch]
            if follower.position == 3:  # all three records read
                return seen
        return seen

    with caplog.at_level(logging.WARNING, logger="topics.follow"):
        assert await asyncio.wait_for(read(), 30) == ["a", "c"]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1
    control = CONTROL.at(settings.kafka)
    assert skipped[0].startswith(f"{control}[0]@1: skipping what is not a Control")
    assert await asyncio.wait_for(read(keep=lambda r: r.key == b"c"), 30) == ["c"]


async def test_a_topic_named_by_a_string_has_no_decoding() -> None:
    follower = follow(load_settings(topic_prefix="t"), "t.keys")
    with pytest.raises(TypeError, match="a topic of the catalog"):
        await follower.events(default_codec()).__anext__()


async def test_a_follower_of_several_partitions_reads_each_in_order_and_resumes(
        services: None) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    topic = CONTROL.at(settings.kafka)
    await create_topic(settings.kafka.bootstrap, topic, 3)
    producer = make_producer(settings.kafka)
    await producer.start()

    async def write(values: list[tuple[int, bytes]]) -> None:
        for partition, value in values:
            await producer.send_and_wait(topic, value, partition=partition)

    try:
        await write([(0, b"a0"), (2, b"c0"), (0, b"a1"), (2, b"c1")])
        follower = follow(settings, topic, [0, 2], "beginning")
        assert [tp.partition for tp in follower.tps] == [0, 2]

        async def read(n: int) -> list[list[tuple[int, bytes]]]:
            batches: list[list[tuple[int, bytes]]] = []
            async for records in follower:
                batches.append([(r.partition, r.value) for r in records])
                if sum(map(len, batches)) >= n:
                    return batches
            return batches

        first = await asyncio.wait_for(read(4), 30)
        assert all(len({p for p, _ in batch}) == 1 for batch in first)  # one partition each
        by_partition = {p: [v for batch in first for q, v in batch if q == p] for p in (0, 2)}
        assert by_partition == {0: [b"a0", b"a1"], 2: [b"c0", b"c1"]}
        assert {tp.partition: at for tp, at in follower.positions.items()} == {0: 2, 2: 2}
        # a new iteration (a new consumer, as after an outage) goes on where it left off
        await write([(1, b"b0"), (2, b"c2"), (0, b"a2")])
        again = await asyncio.wait_for(read(2), 30)
        assert sorted(v for batch in again for _, v in batch) == [b"a2", b"c2"]
        # caught up once every partition's backlog is read
        fresh = follow(settings, topic, [0, 1, 2], "beginning")
        seen: list[bytes] = []

        async def drain() -> None:
            async for records in fresh:
                seen.extend(r.value for r in records)

        draining = asyncio.create_task(drain())
        try:
            await asyncio.wait_for(fresh.caught_up.wait(), 30)
            assert sorted(seen) == [b"a0", b"a1", b"a2", b"b0", b"c0", b"c1", b"c2"]
        finally:
            draining.cancel()
    finally:
        await producer.stop()

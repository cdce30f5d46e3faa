"""A follower of several partitions through a broker restart: blind while the
broker is down, then every partition goes on where it left off, nothing read
twice and nothing skipped."""

from __future__ import annotations

import asyncio
import uuid

from conveyor.settings import Settings, load_settings
from tests.support.key_backends import wait_until
from tests.support.services import OwnKafka
from tests.support.topics import create_topic, send_retrying
from topics.follow import follow


async def write(settings: Settings, topic: str, records: list[tuple[int, bytes]]) -> None:
    await send_retrying(settings, topic, [{"value": v, "partition": p} for p, v in records])


async def test_several_partitions_go_on_where_they_left_off_after_a_restart(
        own_kafka: OwnKafka) -> None:
    settings = load_settings(kafka_bootstrap=own_kafka.bootstrap,
                        topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    topic = settings.kafka.topic("several")
    await create_topic(own_kafka.bootstrap, topic, 3)
    await write(settings, topic, [(0, b"a0"), (1, b"b0"), (2, b"c0")])
    follower = follow(settings, topic, range(3), "beginning")
    seen: list[bytes] = []

    async def read() -> None:
        async for records in follower:
            seen.extend(r.value for r in records)

    reading = asyncio.create_task(read())
    try:
        await wait_until(lambda: len(seen) >= 3, 60, f"the first records: {seen}")
        await asyncio.to_thread(own_kafka.stop)
        await wait_until(lambda: not follower.reachable, 30, "never blind with the broker down")
        await asyncio.to_thread(own_kafka.start)
        await write(settings, topic, [(0, b"a1"), (1, b"b1"), (2, b"c1")])
        await wait_until(lambda: len(seen) >= 6, 90, f"after the restart: {seen}")
        await asyncio.sleep(1)  # anything read twice would show by now
        assert sorted(seen) == [b"a0", b"a1", b"b0", b"b1", b"c0", b"c1"]
        assert follower.reachable
        assert {tp.partition: at for tp, at in follower.positions.items()} == \
            {0: 2, 1: 2, 2: 2}
    finally:
        reading.cancel()

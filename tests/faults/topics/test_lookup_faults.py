"""The process's keyed lookup through a broker restart.

While the broker is down a call fails within its timeout with a transient
error; once the broker is back, the lookup that failed and the one whose
readers sat idle through the restart both answer on their next call, with
the records written before and after it: no reader broken by the outage is
used again.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from conveyor.errors import TransientBrokerError
from conveyor.settings import Settings, load_settings
from tests.support.services import OwnKafka
from tests.support.topics import create_topic, send_retrying
from topics.envelope import now_ms
from topics.lookup import SharedLookup

TIMEOUT_S = 5.0


async def write(settings: Settings, topic: str, value: bytes) -> None:
    """Write one record under key ``k``, retrying until the broker takes it."""
    await send_retrying(settings, topic, [{"value": value, "key": b"k"}])


async def test_a_lookup_answers_again_after_the_broker_restarts(own_kafka: OwnKafka) -> None:
    settings = load_settings(kafka_bootstrap=own_kafka.bootstrap,
                        topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    topic = settings.kafka.topic("lookup")
    await create_topic(own_kafka.bootstrap, topic, 2)
    since = now_ms() - 1000
    await write(settings, topic, b"before")
    used = SharedLookup(settings, readers=2, timeout_s=TIMEOUT_S)  # called in the outage
    idle = SharedLookup(settings, readers=2, timeout_s=TIMEOUT_S)  # not called in it
    try:
        for lookup in (used, idle):
            found = await asyncio.gather(*(lookup.records(topic, "k", since) for _ in range(2)))
            assert [[r.value for r in f] for f in found] == [[b"before"]] * 2
        await asyncio.to_thread(own_kafka.stop)
        started = time.monotonic()
        with pytest.raises(TransientBrokerError, match=f"no answer within {TIMEOUT_S:g} s"):
            await used.records(topic, "k", since)
        # Ended by its own timeout, not by aiokafka's (a 40 s request timeout,
        # then retries). Quiet, the call takes 5.00 s; a CI run with every
        # tier in parallel on two cores once saw 7.01 s of it, the event loop
        # late to deliver the cancellation, so the bound is twice the timeout.
        assert time.monotonic() - started < 2 * TIMEOUT_S
        assert used.discarded == 1 and used.idle == 1  # the reader it cut short is gone

        await asyncio.to_thread(own_kafka.start)
        await write(settings, topic, b"after")  # the partition has a leader again
        for lookup in (used, idle):
            found_after = await lookup.records(topic, "k", since, timeout_s=30)
            assert [r.value for r in found_after] == [b"before", b"after"]
        again = await idle.records(topic, "k", since)
        assert [r.value for r in again] == [b"before", b"after"]
    finally:
        await used.close()
        await idle.close()

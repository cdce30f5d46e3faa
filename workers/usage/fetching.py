"""The accounting app's consumer: it fetches in batches, and a partition nothing
was committed on starts again from its beginning after each rebalance.

**Batches.** Faust makes its aiokafka consumer with ``fetch_min_bytes`` 1, so
the broker answered a fetch for nearly every usage event. Nobody waits on a
usage count, so the broker may hold a fetch until :data:`FETCH_MIN_BYTES` are
there or :data:`FETCH_MAX_WAIT_MS` have passed (measured:
docs/decisions/0002-faust-on-the-cold-path-only.md). Nothing else about the
consumer changes.

**Where a rebalance resumes.** aiokafka's ``seek_to_committed`` seeks only a
partition whose committed offset is above 0: one with nothing committed keeps
its position, past records fetched and then cleared from an agent's queue
(workers/usage/flow.py). :func:`seek_committed_or_earliest` seeks such a
partition to its beginning; what is read again is counted once.

Written against faust-streaming 0.15.3 and aiokafka 0.14.0: the consumer
thread's ``_create_worker_consumer`` and ``seek_to_committed`` overridden,
aiokafka's private ``_fetch_min_bytes`` and ``_fetch_max_wait_ms`` set before
``start()`` reads them, the transport's ``Consumer`` replaced; each pinned by
tests/unit/workers/usage/test_faust_patches.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiokafka
import faust
from aiokafka import TopicPartition
from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["FETCH_MAX_WAIT_MS", "FETCH_MIN_BYTES", "batched_fetch_transport",
           "seek_committed_or_earliest"]

log = logging.getLogger(__name__)

FETCH_MIN_BYTES = 64 * 1024
FETCH_MAX_WAIT_MS = 100


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    # Faust's consumer thread makes the aiokafka consumer here, with every
    # setting from the app's configuration but the fetch sizes, which Faust
    # does not pass on
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # read by AIOKafkaConsumer.start() when it makes its fetcher
        consumer._fetch_min_bytes = FETCH_MIN_BYTES
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer

    # Faust's Consumer.perform_seek (every rebalance's end) calls this through
    # the consumer it delegates to; Faust's own calls aiokafka's, which skips
    # a partition with no commit
    async def seek_to_committed(self) -> Mapping[Any, int]:
        counted: frozenset[str] = getattr(self.transport, "counted_topics", frozenset())
        consumer = self._ensure_consumer()
        return await self.call_thread(  # type: ignore[no-any-return]
            seek_committed_or_earliest, consumer, lambda tp: tp.topic in counted)


async def seek_committed_or_earliest(
        consumer: aiokafka.AIOKafkaConsumer,
        restart: Callable[[TopicPartition], bool] = lambda tp: True,
) -> dict[TopicPartition, int | None]:
    """Seek every assigned partition to its committed offset, and those with
    none (or 0) for which ``restart`` holds to their beginning; the committed
    offsets, as aiokafka's ``seek_to_committed`` returns them. (The app asks
    it for the topics it counts: a table's changelog has no commits, and
    Faust's recovery positions it itself.)"""
    committed: dict[TopicPartition, int | None] = await consumer.seek_to_committed()
    fresh = [tp for tp, offset in committed.items() if not offset and restart(tp)]
    if fresh:
        log.info("accounting: nothing committed on %s: read from the beginning",
                 ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in fresh)))
        await consumer.seek_to_beginning(*fresh)
    return committed


class _Consumer(faust_aiokafka.Consumer):
    # the one seam Faust gives to choose the consumer thread's class
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Transport(faust_aiokafka.Transport):
    Consumer = _Consumer  # Transport.create_consumer makes self.Consumer
    counted_topics: frozenset[str] = frozenset()


def batched_fetch_transport(app: faust.App, counted: frozenset[str]
                            ) -> faust_aiokafka.Transport:
    """A transport for ``app`` (set before it starts) whose consumer fetches in
    batches and reads the partitions of ``counted`` (the topics the app counts)
    that have no commit from their beginning after a rebalance."""
    transport = _Transport(app.conf.broker_consumer, app)
    transport.counted_topics = counted
    return transport

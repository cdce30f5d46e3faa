"""The accounting app's consumer: it fetches in batches, and a partition nothing
was committed on starts again from its beginning after each rebalance.

**Batches.** Nobody waits on a usage event.

Faust's aiokafka driver makes its consumer with ``fetch_min_bytes`` left at 1, so
the broker answers a fetch as soon as one record is there: at a few hundred
requests a second that is a fetch, a response and a hand-over from Faust's
consumer thread to its event loop for nearly every usage event, most of the
accounting app's CPU in ``bench.profile`` (measured:
docs/decisions/0002-faust-on-the-cold-path-only.md). Counting is off the
request's path (the client has its
answer), so the broker may hold a fetch until :data:`FETCH_MIN_BYTES` are
there or :data:`FETCH_MAX_WAIT_MS` have passed: usage counts arrive up to that
much later, in fewer and fuller fetches.

:func:`batched_fetch_transport` is the transport the app then uses in place of
Faust's own; it changes nothing else about the consumer (the same group,
commits, rebalances and table recovery, whose reads fill any batch at once).

**Where a rebalance resumes.** Faust ends every rebalance by seeking the stream
partitions to their committed offsets and then clearing the agents' queues of
what was fetched meanwhile (workers/usage/flow.py holds the flow for that). But
aiokafka's ``seek_to_committed`` seeks only a partition whose committed offset
is above 0: one with nothing committed yet keeps its position, past records
fetched and then cleared from a queue, which nothing reads again while the
member lives. That fits CI's ratings stall: a member started beside two dead
ones held ``conveyor.feedback`` (one partition, never committed), the test's
601 events fit in one fetch, a second rebalance (a dead member's session
ending) can clear them, and the member then counted no rating, the poison
event included. :func:`seek_committed_or_earliest` seeks such a partition to its
beginning, where a member given it for the first time starts
(``auto_offset_reset=earliest``); what it reads again there is counted once
(each ledger row keeps the position of the last event applied to it).

**Faust's internals.** Written against faust-streaming 0.15.3 and aiokafka 0.14.0:
the consumer thread's ``_create_worker_consumer`` and ``seek_to_committed``
are overridden, aiokafka's private ``_fetch_min_bytes`` and
``_fetch_max_wait_ms`` set before its ``start()`` reads them, and the
transport's ``Consumer`` class replaced; each is pinned by
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

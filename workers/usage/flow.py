"""The accounting app's consumer around a rebalance, and its fetches:
:func:`hold_flow_until_resumed` holds the flow from Faust's end of a
rebalance until its own resume (raising ``RebalanceAgain`` when another
began), :func:`batched_fetch_transport` fetches in batches and reads a
partition never committed from its beginning
(:func:`seek_committed_or_earliest`). Why, and the internals relied on:
docs/decisions/0002-faust-on-the-cold-path-only.md; pinned by
tests/unit/workers/usage/test_faust_patches.py."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiokafka
import faust
from aiokafka import TopicPartition
from faust.tables.recovery import RebalanceAgain
from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["hold_flow_until_resumed", "FETCH_MAX_WAIT_MS", "FETCH_MIN_BYTES",
           "batched_fetch_transport", "has_position", "seek_committed_or_earliest"]

log = logging.getLogger(__name__)


class _Hold:
    """The receivers of one app's signals: the rebalance count as of the last
    assignment, and the hold."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.assigned_at: int = app.rebalancing_count

    async def on_assigned(self, sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # sent at the end of App._on_partitions_assigned, after the tables'
        # on_rebalance started that generation's recovery
        self.assigned_at = self.app.rebalancing_count

    async def on_complete(self, sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # Consumer.stop_flow: getmany waits for resume_flow, and what a fetch
        # returns meanwhile is not handed on but read again (perform_seek)
        self.app.consumer.stop_flow()
        if self.app.rebalancing_count != self.assigned_at:
            log.info("accounting: a rebalance began before the last one's recovery ended; "
                     "the next assignment's recovery resumes the partitions")
            # caught by Recovery._restart_recovery, which waits for that assignment
            raise RebalanceAgain()


def hold_flow_until_resumed(app: Any) -> None:
    """Connect the hold to ``app`` (a faust.App, before it starts)."""
    hold = _Hold(app)
    app.on_partitions_assigned.connect(hold.on_assigned)
    app.on_rebalance_complete.connect(hold.on_complete)


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


    # Faust's commit livelock check reads each partition's position, which
    # aiokafka asserts is set; a partition read from its beginning (nothing
    # committed: seek_committed_or_earliest) has none until its reset lands.
    # Such a partition is checked once it has one (decision 0002).
    def verify_event_path(self, now: float, tp: Any) -> None:
        if not has_position(self._ensure_consumer(), tp):
            return None
        return super().verify_event_path(now, tp)  # type: ignore[no-any-return]


def has_position(consumer: aiokafka.AIOKafkaConsumer, tp: Any) -> bool:
    """Whether ``consumer`` holds a position for assigned partition ``tp``
    (aiokafka 0.14's subscription state; tests/unit/workers/usage/test_faust_patches.py)."""
    assignment = consumer._fetcher._subscriptions.subscription.assignment
    state = assignment.state_value(TopicPartition(tp.topic, tp.partition))
    return state is not None and bool(state.has_valid_position)


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

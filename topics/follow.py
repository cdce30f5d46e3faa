"""Tailing a partition (or several, on one consumer) through broker outages:
the one reader every follower of a side topic uses (heartbeats, cancels,
replies, progress). A :class:`Follower` yields record batches (or decoded
events), never raises for the broker (it backs off and reconnects where it
left off), and tells "nothing happened" from "I cannot see" (``reachable``).
Usage and the rules: docs/architecture.md#reading-the-log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

from aiokafka import TopicPartition

from conveyor.settings import Settings
from schemas.codec import Codec
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import Topic
from topics.clients import (
    BROKER_TROUBLE,
    IDLE_FETCH_WAIT_MS,
    broker_error,
    hold_fetches,
    make_consumer,
    stop_consumer,
)
from topics.envelope import now_ms
from topics.reader import PoisonReport, Record, decoded

__all__ = ["FromTime", "Follower", "Record", "Start", "apply_all", "follow", "snapshot"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FromTime:
    """Start at the first record written at or after ``ms`` (wall clock)."""

    ms: int


Start = Literal["beginning", "end"] | int | FromTime
T = TypeVar("T")


class Follower(Generic[T]):
    """An async iterable of record batches of one partition or several; see the module."""

    def __init__(self, settings: Settings, topic: str, partition: int | Iterable[int] = 0,
                 start: Start = "beginning", *, typed: Topic[T] | None = None,
                 poll_ms: int = 500, probe_s: float = 1.0, probe_timeout_s: float = 2.0,
                 **consumer_options: Any) -> None:
        self.settings = settings
        self.typed = typed  # what events() decodes: the topic's events
        parts = [partition] if isinstance(partition, int) else list(partition)
        if not parts:
            raise ValueError(f"a follower of {topic} needs a partition")
        self.tps = [TopicPartition(topic, p) for p in parts]
        self.tp = self.tps[0]  # the first (a single-partition follower's only one)
        self.start = start
        self.poll_ms = poll_ms
        self.probe_s = probe_s
        self.probe_timeout_s = probe_timeout_s
        self.consumer_options = consumer_options
        # the next offset to read of each partition, once known
        self.positions: dict[TopicPartition, int] = {}
        self.caught_up = asyncio.Event()
        self.last_contact_ms = 0
        # when contact came back after the follower had been blind (0: never lost)
        self.regained_ms = 0
        self._last_contact = float("-inf")
        self._contacted = asyncio.Event()
        self._problems = RateLimitedLog(log)

    @property
    def position(self) -> int | None:
        """The next offset to read of the (first) partition, once known."""
        return self.positions.get(self.tp)

    @property
    def stale_after_s(self) -> float:
        """How long without an answer before the follower counts as blind."""
        return self.probe_s + self.probe_timeout_s + self.poll_ms / 1000

    @property
    def reachable(self) -> bool:
        return time.monotonic() - self._last_contact <= self.stale_after_s

    def _contact(self) -> None:
        if self.last_contact_ms and not self.reachable:
            self.regained_ms = now_ms()
        self._last_contact = time.monotonic()
        self.last_contact_ms = now_ms()
        self._contacted.set()

    async def reachability(self) -> AsyncIterator[bool]:
        """:attr:`reachable` now, then each time it changes, when it changes:
        blind once ``stale_after_s`` passes without an answer, seeing again at
        the first answer. Runs beside the iteration that reads the records."""
        seen = self.reachable
        yield seen
        while True:
            if self.reachable:  # wake just past the moment it would turn blind
                await asyncio.sleep(self._last_contact + self.stale_after_s
                                    - time.monotonic() + 0.01)
            else:
                self._contacted.clear()
                await self._contacted.wait()
            if self.reachable != seen:
                seen = not seen
                yield seen

    async def locate(self) -> int:
        """Resolve the start to an offset now (see the module) and return it;
        the iteration reads from there. Broker trouble is raised, translated
        (:func:`~topics.clients.broker_error`)."""
        consumer = make_consumer(self.settings.kafka, group=None, **self.consumer_options)
        try:
            await consumer.start()
            consumer.assign(self.tps)
            await self._seek(consumer)
            self._contact()
        except BROKER_TROUBLE as exc:
            raise broker_error(exc) from exc
        finally:
            await stop_consumer(consumer, self.probe_timeout_s)
        return self.positions[self.tp]

    @property
    def _batching(self) -> bool:
        """Its fetches are held for a batch (``fetch_min_bytes`` over one byte)."""
        return int(self.consumer_options.get("fetch_min_bytes", 1)) > 1

    def _hold(self, consumer: Any, batches: bool) -> None:
        """A batching follower's fetches: held for a batch while records come; a
        poll without any makes them an idle consumer's, answered at the first
        record and asked twice a second, not every few milliseconds."""
        if batches:
            hold_fetches(consumer,
                         self.consumer_options.get("fetch_max_wait_ms", IDLE_FETCH_WAIT_MS),
                         self.consumer_options["fetch_min_bytes"])
        else:
            hold_fetches(consumer, IDLE_FETCH_WAIT_MS, 1)

    def __aiter__(self) -> AsyncIterator[list[Record]]:
        return self.batches()

    async def batches(self) -> AsyncIterator[list[Record]]:
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        tps = self.tps
        where = f"{self.tp.topic}[{','.join(str(tp.partition) for tp in tps)}]"
        while True:
            consumer = make_consumer(self.settings.kafka, group=None, **self.consumer_options)
            try:
                await consumer.start()
                consumer.assign(tps)
                await self._seek(consumer)
                ends = await self._end_offsets(consumer)
                self._problems.resolved("follow", "%s: following again", self.tp.topic)
                backoff.reset()
                held = True  # its fetches held as asked (not as an idle consumer's)
                while True:
                    if not self.caught_up.is_set() and await _reached(consumer, ends):
                        self.caught_up.set()
                    batch = await consumer.getmany(*tps, timeout_ms=self.poll_ms)
                    if self._batching and held != any(batch.values()):
                        held = not held
                        self._hold(consumer, held)
                    if any(batch.values()):
                        self._contact()
                        for tp in tps:
                            records = batch.get(tp)
                            if records:
                                # moved on just before the hand-over: a reader
                                # that stops here has what it was given
                                self.positions[tp] = records[-1].offset + 1
                                yield records
                    elif time.monotonic() - self._last_contact >= self.probe_s:
                        await self._end_offsets(consumer)
            except BROKER_TROUBLE as exc:
                self._problems.warning("follow", "%s: cannot follow %s (%s: %s); retrying",
                                       self.tp.topic, where, type(exc).__name__, exc)
            finally:
                await stop_consumer(consumer, self.probe_timeout_s)
            _raise_if_cancelled()  # a cancel the client turned into broker trouble
            await backoff.wait()

    async def events(self, codec: Codec, *, keep: Callable[[Record], bool] | None = None
                     ) -> AsyncIterator[list[tuple[Record, T]]]:
        """The batches decoded as the topic's events: (record, event) pairs of
        the records ``keep`` accepts (all by default). A record that does not
        decode is reported (topics/reader.py) and skipped: a poison event never
        stops a follower. A batch may come out empty when ``keep`` took nothing
        of it, so a reader still looks at its state after each batch."""
        if self.typed is None:
            raise TypeError(f"{self.tp.topic}: events() needs a topic of the catalog")
        typed, poison = self.typed, PoisonReport(log, self.typed)
        async for records in self.batches():
            kept = records if keep is None else [r for r in records if keep(r)]
            yield decoded(typed, codec, kept, poison)

    async def _end_offsets(self, consumer: Any) -> dict[TopicPartition, int]:
        ends = await asyncio.wait_for(consumer.end_offsets(self.tps), self.probe_timeout_s)
        self._contact()
        return {tp: int(ends[tp]) for tp in self.tps}

    async def _seek(self, consumer: Any) -> None:
        """Each partition to where this follower left off, else to its start (the
        partitions reset to their beginning or end in one request each)."""
        found: dict[TopicPartition, Any] = {}
        if isinstance(self.start, FromTime) and len(self.positions) < len(self.tps):
            found = await asyncio.wait_for(
                consumer.offsets_for_times({tp: self.start.ms for tp in self.tps}),
                self.probe_timeout_s)
        to_beginning: list[TopicPartition] = []
        to_end: list[TopicPartition] = []
        for tp in self.tps:
            if tp in self.positions:
                consumer.seek(tp, self.positions[tp])
            elif self.start == "beginning":
                to_beginning.append(tp)
            elif self.start == "end":
                to_end.append(tp)
            elif isinstance(self.start, FromTime):
                hit = found.get(tp)
                if hit is None:
                    to_end.append(tp)
                else:
                    consumer.seek(tp, hit.offset)
            else:
                consumer.seek(tp, int(self.start))
        if to_beginning:
            await consumer.seek_to_beginning(*to_beginning)
        if to_end:
            await consumer.seek_to_end(*to_end)
        for tp in self.tps:
            self.positions[tp] = await consumer.position(tp)


async def _reached(consumer: Any, ends: dict[TopicPartition, int]) -> bool:
    """Whether the consumer's position is at ``ends`` or past it, in every partition."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True


def _raise_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop: a client library
    that catches the cancel and raises its own error instead must not turn it
    into a retry."""
    me = asyncio.current_task()
    if me is not None and me.cancelling():
        raise asyncio.CancelledError


@overload
def follow(settings: Settings, topic: Topic[T], partition: int | Iterable[int] = 0,
           start: Start = "beginning", **options: Any) -> Follower[T]: ...


@overload
def follow(settings: Settings, topic: str, partition: int | Iterable[int] = 0,
           start: Start = "beginning", **options: Any) -> Follower[Any]: ...


def follow(settings: Settings, topic: Topic[T] | str, partition: int | Iterable[int] = 0,
           start: Start = "beginning", **options: Any) -> Follower[T] | Follower[Any]:
    """A :class:`Follower` of ``topic[partition]`` (or of several partitions) from
    ``start``; a topic of the catalog gives :meth:`Follower.events` what to
    decode (a ``Follower[T]`` of a ``Topic[T]``)."""
    if isinstance(topic, str):
        return Follower(settings, topic, partition, start, **options)
    return Follower(settings, topic.at(settings.kafka), partition, start, typed=topic, **options)


async def apply_all(follower: Follower[T], codec: Codec, apply: Callable[[T], object],
                    caught_up: Callable[[], None] | None = None) -> None:
    """Hand every event of ``follower`` to ``apply``, for ever (through broker
    outages); ``caught_up`` is called once the events written before the start
    are applied. The way to hold the latest state of a compacted topic (the
    worker table, the job board)."""

    async def signal() -> None:
        await follower.caught_up.wait()
        if caught_up is not None:
            caught_up()

    signalling = asyncio.create_task(signal(), name=f"caught-up {follower.tp.topic}")
    try:
        async for batch in follower.events(codec):
            for _, event in batch:
                apply(event)
    finally:
        signalling.cancel()


async def snapshot(follower: Follower[T], codec: Codec, apply: Callable[[T], object],
                   within_s: float) -> None:
    """Hand the events written before now to ``apply``, then stop (a command
    reading a compacted topic's state once); TimeoutError past ``within_s``."""
    reading = asyncio.create_task(apply_all(follower, codec, apply))
    try:
        await asyncio.wait_for(follower.caught_up.wait(), within_s)
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading

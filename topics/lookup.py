"""Finding one key's events in a topic between two times, without scanning
the topic: ``offsets_for_times`` in the key's partition (murmur2, as every
producer partitions), read up to the end offset seen when the lookup began.
:class:`KeyLookup` is one reader; :class:`SharedLookup` the process's pool of
them (docs/decisions/0021-one-shared-lookup.md), every call bounded by its
timeout and aiokafka's errors raised as Conveyor's. Usage:
docs/architecture.md#reading-the-log.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from conveyor.errors import BrokerError, TransientBrokerError
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from topics.catalog import Topic
from topics.clients import BROKER_TROUBLE, KafkaError, broker_error, make_consumer, make_producer
from topics.envelope import request_time_ms
from topics.producer import Producer
from topics.reader import PoisonReport, Record, decoded, holds

__all__ = ["KeyLookup", "LookupClosed", "Record", "SharedLookup", "key_partition",
           "parse_since", "made_window"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_FETCH_WAIT_MS = 10
_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2) gives ``key``."""
    every = list(range(partitions))
    return int(DefaultPartitioner()(key, every, every))


# how old a request id's time may be and still be trusted (longer than any
# topic keeps a request), and how long after its id was made a request event
# is written at most (admission, the producer's retries)
_RETAINED_MS = 400 * 24 * 3600 * 1000
_SUBMIT_WITHIN_MS = 120_000


def made_window(request_id: str, skew_ms: int, now_ms: int) -> tuple[int, int] | None:
    """The record times (since, until) between which the request event of an id
    from topics.envelope.new_request_id was written; None for another id."""
    made = request_time_ms(request_id)
    if made is None or not now_ms - _RETAINED_MS <= made <= now_ms + skew_ms:
        return None
    return made - skew_ms, made + skew_ms + _SUBMIT_WITHIN_MS


def parse_since(text: str, now_ms: int | None = None) -> int:
    """A time the CLI is given, as epoch milliseconds: ``now``, ``24h``/``90m``/
    ``2d``/``30s`` ago, an ISO 8601 date or time (UTC unless it says otherwise),
    or epoch milliseconds; ValueError for anything else."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    text = text.strip()
    if text == "now":
        return now
    ago = _AGO.match(text)
    if ago:
        return now - int(float(ago.group(1)) * _UNITS_S[ago.group(2)] * 1000)
    if text.isdigit():
        return int(text)
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a date (2026-11-01), a time (2026-11-01T12:30Z), "
                         "a duration before now (90m, 24h, 7d), 'now' or epoch ms") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp() * 1000)


class KeyLookup:
    """One reader (a group-less consumer) and the topics' partition counts."""

    def __init__(self, settings: Settings, *, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        # a lookup reads up to an end offset it knows: it never waits for new
        # records, and a short wait frees the connection at once for the next call
        self._consumer: AIOKafkaConsumer = make_consumer(settings.kafka, group=None,
                                                         fetch_max_wait_ms=_FETCH_WAIT_MS)
        # only asked for metadata: the producer knows a topic's partitions
        self._meta: Producer = make_producer(settings.kafka, enable_idempotence=False)
        # what each find read: topic -> [(partition, first offset, next offset)]
        self.read: dict[str, list[tuple[int, int, int]]] = {}

    async def __aenter__(self) -> KeyLookup:
        try:
            await self.start()
        except BaseException:
            await self.close()  # the client that did start, and the one that did not
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        await self._consumer.start()
        await self._meta.start()

    async def close(self) -> None:
        """Stop both clients; safe on a lookup that never started, and twice."""
        await self._consumer.stop()
        await self._meta.stop()

    async def partitions(self, topic: str) -> list[int]:
        """The topic's partitions (waits for metadata; an unknown topic raises)."""
        found = await asyncio.wait_for(self._meta.partitions_for(topic), self.timeout_s)
        return sorted(found)

    async def find(self, topic: str, key: str | None, since_ms: int,
                   until_ms: int | None = None, *, partitions: list[int] | None = None,
                   first: bool = False) -> list[Record]:
        """The records with ``key`` (every record when None) written between
        ``since_ms`` and ``until_ms``, in ``partitions`` (default: the key's),
        in offset order per partition; ``first``: stop at the first match."""
        wanted = key.encode() if key is not None else None
        if partitions is None:
            partitions = await self.partitions(topic)
            if wanted is not None:
                partitions = [key_partition(wanted, len(partitions))]
        found: list[Record] = []
        for partition in partitions:
            tp = TopicPartition(topic, partition)
            found += await asyncio.wait_for(
                self._since(tp, wanted, since_ms, until_ms, first), self.timeout_s)
            if first and found:
                break
        return found

    async def last(self, topic: str, count: int) -> list[Record]:
        """The last ``count`` records of each of ``topic``'s partitions (fewer
        where it holds fewer), in offset order per partition: what just came."""
        async with asyncio.timeout(self.timeout_s):
            await self.track(topic)
            tps = [TopicPartition(topic, p) for p in await self.partitions(topic)]
            ends = await self._consumer.end_offsets(tps)
            found: list[Record] = []
            for tp in tps:
                if ends[tp]:
                    found += await self._read(tp, None, max(0, ends[tp] - count), None, False)
            return found

    async def at(self, topic: str, partition: int, offset: int) -> Record | None:
        """The record at one offset, or None when there is none (any more)."""
        if offset < 0:
            return None  # no record is there
        async with asyncio.timeout(self.timeout_s):
            await self.track(topic)
            found = await self._read(TopicPartition(topic, partition), None, offset, None, True)
        return found[0] if found and found[0].offset == offset else None

    async def track(self, topic: str) -> None:
        """Have the consumer know ``topic``'s partition leaders before it asks for
        offsets there, not learn them from a failed offset request and its retry
        backoff (docs/benchmarks/results/console.md). Through aiokafka 0.14's
        client (private; tests/kafka/topics/test_shared_lookup.py pins it)."""
        client = self._consumer._client
        if topic not in client._topics:
            await client.set_topics({*client._topics, topic})

    async def _since(self, tp: TopicPartition, key: bytes | None, since_ms: int,
                     until_ms: int | None, first: bool) -> list[Record]:
        await self.track(tp.topic)
        hit = (await self._consumer.offsets_for_times({tp: max(0, since_ms)}))[tp]
        if hit is None:
            return []  # nothing written to the partition since then
        return await self._read(tp, key, hit.offset, until_ms, first)

    async def _read(self, tp: TopicPartition, key: bytes | None, start: int,
                    until_ms: int | None, first: bool) -> list[Record]:
        """``tp``'s records (``key``'s) from offset ``start`` on, up to the end
        offset seen as the read began or past ``until_ms``."""
        consumer = self._consumer
        consumer.assign([tp])
        try:
            consumer.seek(tp, start)
            end = (await consumer.end_offsets([tp]))[tp]
            found: list[Record] = []
            position = start
            try:
                while position < end:
                    batch = await consumer.getmany(tp, timeout_ms=500)
                    for record in batch.get(tp, []):
                        position = record.offset + 1
                        if record.offset >= end or (until_ms is not None
                                                    and record.timestamp > until_ms):
                            return found
                        if key is None or holds(record, key):
                            found.append(record)
                            if first:
                                return found
                return found
            finally:
                self.read.setdefault(tp.topic, []).append((tp.partition, start, position))
        finally:
            self._idle(tp)

    def _idle(self, tp: TopicPartition) -> None:
        """Stop fetching ``tp`` once a read is done (it stays assigned): an idle
        fetch at the partition's end would hold the connection, and the next
        call's offset requests would queue behind it."""
        if tp in self._consumer.assignment():
            self._consumer.pause(tp)

    @staticmethod
    def describe(read: dict[str, list[tuple[int, int, int]]]) -> list[dict[str, Any]]:
        """What was read, for a report: topic, partition, offsets, count."""
        return [{"topic": topic, "partition": p, "from": a, "to": b, "records": b - a}
                for topic, spans in read.items() for p, a, b in spans]


_CLOSE_WITHIN_S = 5.0


class LookupClosed(TransientBrokerError):
    """A call after the process's lookup was closed (it is shutting down)."""


class SharedLookup:
    """Up to ``readers`` long-lived readers shared by every caller; see the module."""

    def __init__(self, settings: Settings, *, readers: int = 4, timeout_s: float = 10.0,
                 make_reader: Callable[[], KeyLookup] | None = None,
                 codec: Codec | None = None) -> None:
        if readers < 1:
            raise ValueError("a lookup needs at least one reader")
        self.settings = settings
        self.codec = codec or default_codec()
        self.timeout_s = timeout_s
        self.size = readers
        self._make = make_reader or (lambda: KeyLookup(settings, timeout_s=timeout_s))
        self._slots = asyncio.Semaphore(readers)
        self._idle: list[KeyLookup] = []
        self._live: set[KeyLookup] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.started = 0  # readers started so far
        self.discarded = 0  # readers closed after a failed or cut-short call

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def find(self, topic: Topic[T], key: str | None, since_ms: int,
                   until_ms: int | None = None, *, partitions: list[int] | None = None,
                   first: bool = False, timeout_s: float | None = None
                   ) -> list[tuple[Record, T]]:
        """The events of ``key`` on ``topic`` between two times (see
        :meth:`records`), decoded: (record, event) pairs; a value that does not
        decode is reported and left out (topics/reader.py)."""
        found = await self.records(topic.at(self.settings.kafka), key, since_ms, until_ms,
                                   partitions=partitions, first=first, timeout_s=timeout_s)
        return decoded(topic, self.codec, found, PoisonReport(log, topic), key)

    async def records(self, topic: str, key: str | None, since_ms: int,
                      until_ms: int | None = None, *, partitions: list[int] | None = None,
                      first: bool = False, timeout_s: float | None = None) -> list[Record]:
        """:meth:`KeyLookup.find` on a shared reader, within ``timeout_s`` (the
        lookup's own when None): the records as they are."""
        return await self._call(f"finding {key!r} in {topic}", lambda reader: reader.find(
            topic, key, since_ms, until_ms, partitions=partitions, first=first), timeout_s)

    async def last(self, topic: str, count: int, *,
                   timeout_s: float | None = None) -> list[Record]:
        """:meth:`KeyLookup.last` on a shared reader: the last ``count`` records
        of each of ``topic``'s partitions."""
        return await self._call(f"reading the last {count} of {topic}",
                                lambda reader: reader.last(topic, count), timeout_s)

    async def at(self, topic: str, partition: int, offset: int, *,
                 timeout_s: float | None = None) -> Record | None:
        """The record at one offset, or None when there is none (any more)."""
        return await self._call(f"reading {topic}[{partition}]@{offset}",
                                lambda reader: reader.at(topic, partition, offset), timeout_s)

    async def close(self) -> None:
        """Close every reader, idle or busy (a busy call then fails); later calls
        raise :class:`LookupClosed`."""
        self._closed = True
        for reader in list(self._live):
            self._discard(reader, failed=False)
        self._idle.clear()
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # -- one call -----------------------------------------------------------

    async def _call(self, what: str, use: Callable[[KeyLookup], Awaitable[R]],
                    timeout_s: float | None) -> R:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._attempts(use)
        except BrokerError:
            raise
        except TimeoutError as exc:
            raise TransientBrokerError(f"{what}: no answer within {limit:g} s") from exc
        except (KafkaError, OSError) as exc:
            raise broker_error(exc) from exc

    async def _attempts(self, use: Callable[[KeyLookup], Awaitable[R]]) -> R:
        async with self._slots:
            fresh = False
            while True:
                reader, fresh = await self._take()
                try:
                    result = await use(reader)
                except BROKER_TROUBLE as exc:
                    self._discard(reader)
                    if fresh:
                        raise
                    log.info("keyed lookup: a reader failed (%r); trying a fresh one", exc)
                    continue  # the failed reader was reused: once more, on a new one
                except BaseException:  # another error, or the call was cut short
                    self._discard(reader)
                    raise
                self._give_back(reader)
                return result

    async def _take(self) -> tuple[KeyLookup, bool]:
        """An idle reader, or a new started one (True)."""
        if self._closed:
            raise LookupClosed("the keyed lookup is closed")
        if self._idle:
            return self._idle.pop(), False
        reader = self._make()
        self._live.add(reader)
        try:
            await reader.start()
        except BaseException:
            self._discard(reader)
            raise
        self.started += 1
        return reader, True

    def _give_back(self, reader: KeyLookup) -> None:
        reader.read.clear()  # what a call read is its own; kept, it would grow for ever
        if self._closed:
            self._discard(reader, failed=False)
        else:
            self._idle.append(reader)

    def _discard(self, reader: KeyLookup, *, failed: bool = True) -> None:
        """Close ``reader`` in the background and forget it."""
        if reader not in self._live:
            return
        self._live.discard(reader)
        with contextlib.suppress(ValueError):
            self._idle.remove(reader)
        self.discarded += failed
        task = asyncio.create_task(_close(reader), name="lookup-reader-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def _close(reader: KeyLookup) -> None:
    try:
        await asyncio.wait_for(reader.close(), _CLOSE_WITHIN_S)
    except Exception as exc:  # the reader is forgotten either way
        log.info("keyed lookup: closing a reader failed: %r", exc)

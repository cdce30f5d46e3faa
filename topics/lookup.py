"""Finding one key's events in a topic from a time, without scanning the topic.

    async with KeyLookup(settings) as lookup:
        records = await lookup.find("conveyor.tokens", request_id, since_ms, until_ms)

A keyed topic holds every event of a key in one partition: the one Kafka's
default partitioner picks, murmur2 of the key's bytes modulo the topic's
partition count (:func:`key_partition`, the same function every Conveyor
producer partitions with: ``make_producer`` keeps aiokafka's
``DefaultPartitioner``, which is the Java client's). Within that partition the
event's time bounds the offsets: ``offsets_for_times(since_ms)`` gives the
first offset written at or after ``since_ms``, and reading stops at the
partition's end offset seen when the lookup began, or at the first record
stamped after ``until_ms``, whichever comes first. What is read is therefore
one partition's traffic between two times, whatever the topic's size.

Topics whose partition is not the key's (a pool's task topic: partition = the
chosen worker's; replies: partition = the gateway's) are read the same way
over the partitions the caller names (``partitions=``).

Record times are the producers' clocks (``CreateTime``), so callers widen the
window by ``settings.clock_skew_ms`` on both sides.

A ``KeyLookup`` starts two clients; a process that looks keys up while it
serves (the gateway's resumes and stored answers, an infer worker's retries)
shares long-lived ones through :class:`topics.shared_lookup.SharedLookup`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from typing import Any, TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from conveyor.settings import Settings
from topics.clients import make_consumer, make_producer
from topics.envelope import request_time_ms
from topics.producer import EventProducer

__all__ = ["KeyLookup", "Record", "key_partition", "parse_since", "made_window"]

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"

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
    """A time hint as epoch milliseconds: ``24h``/``90m``/``2d``/``30s`` ago, an
    ISO 8601 time (UTC unless it says otherwise), or epoch milliseconds."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    text = text.strip()
    ago = _AGO.match(text)
    if ago:
        return now - int(float(ago.group(1)) * _UNITS_S[ago.group(2)] * 1000)
    if text.isdigit():
        return int(text)
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"not a time: {text!r} (say 24h, 90m, 2d, an ISO time or epoch ms)"
                         ) from exc
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
        self._consumer: AIOKafkaConsumer = make_consumer(settings, group=None,
                                                         fetch_max_wait_ms=_FETCH_WAIT_MS)
        # only asked for metadata: the producer knows a topic's partitions
        self._meta: EventProducer = make_producer(settings, enable_idempotence=False)
        # what each find read: topic -> [(partition, first offset, next offset)]
        self.read: dict[str, list[tuple[int, int, int]]] = {}

    async def __aenter__(self) -> KeyLookup:
        await self.start()
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

    async def partition_of(self, topic: str, key: str) -> int:
        return key_partition(key.encode(), len(await self.partitions(topic)))

    async def find(self, topic: str, key: str | None, since_ms: int,
                   until_ms: int | None = None, *, partitions: list[int] | None = None,
                   first: bool = False) -> list[Record]:
        """The records with ``key`` (every record when None) written between
        ``since_ms`` and ``until_ms``, in ``partitions`` (default: the key's),
        in offset order per partition; ``first``: stop at the first match."""
        if partitions is None:
            if key is None:
                partitions = await self.partitions(topic)
            else:
                partitions = [await self.partition_of(topic, key)]
        wanted = key.encode() if key is not None else None
        found: list[Record] = []
        for partition in partitions:
            tp = TopicPartition(topic, partition)
            found += await asyncio.wait_for(
                self._read(tp, wanted, since_ms, until_ms, first), self.timeout_s)
            if first and found:
                break
        return found

    async def at(self, topic: str, partition: int, offset: int) -> Record | None:
        """The record at one offset, or None when there is none (any more)."""
        tp = TopicPartition(topic, partition)
        consumer = self._consumer
        consumer.assign([tp])
        try:
            start = (await consumer.beginning_offsets([tp]))[tp]
            end = (await consumer.end_offsets([tp]))[tp]
            if not start <= offset < end:
                return None
            consumer.seek(tp, offset)
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                batch = await consumer.getmany(tp, timeout_ms=500, max_records=1)
                for record in batch.get(tp, []):
                    return record if record.offset == offset else None
            raise TimeoutError(f"no answer reading {topic}[{partition}]@{offset}")
        finally:
            self._idle(tp)

    async def _read(self, tp: TopicPartition, key: bytes | None, since_ms: int,
                    until_ms: int | None, first: bool) -> list[Record]:
        consumer = self._consumer
        consumer.assign([tp])
        try:
            hit = (await consumer.offsets_for_times({tp: max(0, since_ms)}))[tp]
            if hit is None:
                return []  # nothing written to the partition since then
            end = (await consumer.end_offsets([tp]))[tp]
            consumer.seek(tp, hit.offset)
            found: list[Record] = []
            position = hit.offset
            try:
                while position < end:
                    batch = await consumer.getmany(tp, timeout_ms=500)
                    for record in batch.get(tp, []):
                        position = record.offset + 1
                        if record.offset >= end or (until_ms is not None
                                                    and record.timestamp > until_ms):
                            return found
                        if key is None or record.key == key:
                            found.append(record)
                            if first:
                                return found
                return found
            finally:
                self.read.setdefault(tp.topic, []).append((tp.partition, hit.offset, position))
        finally:
            self._idle(tp)

    def _idle(self, tp: TopicPartition) -> None:
        """Stop fetching ``tp`` once a read is done. The partition stays assigned
        (assigning another topic asks the broker for metadata), but a lookup kept
        for later calls polls nothing, and the next call's offset requests do not
        queue behind a fetch waiting at the partition's end (a broker answers one
        request of a connection at a time: that wait cost each reused lookup's
        ``offsets_for_times`` 100 ms)."""
        if tp in self._consumer.assignment():
            self._consumer.pause(tp)

    @staticmethod
    def describe(read: dict[str, list[tuple[int, int, int]]]) -> list[dict[str, Any]]:
        """What was read, for a report: topic, partition, offsets, count."""
        return [{"topic": topic, "partition": p, "from": a, "to": b, "records": b - a}
                for topic, spans in read.items() for p, a, b in spans]

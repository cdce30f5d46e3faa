"""Reading records as their topic's events: the fetch step (:func:`fetch`, a
``getmany`` that waits a failing broker out) and the decode step
(:func:`decoded`, ``(record, event)`` pairs typed by the topic) every reader
of Kafka shares. A value that does not decode goes to ``poison``: dead-lettered
by a consumer group that owns its records, reported (:class:`PoisonReport`) by
a reader that does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias, TypeVar, cast

from aiokafka import ConsumerRecord, TopicPartition

from conveyor.errors import SchemaError
from schemas.codec import Codec
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import Topic
from topics.clients import KafkaError, broker_error

__all__ = ["ENDED_IDS", "Poison", "PoisonReport", "REQUEST_IDS", "Record", "decoded",
           "ended_ids", "ended_ids_header", "fetch", "holds", "request_ids",
           "request_ids_header"]

REQUEST_IDS = "request-ids"
ENDED_IDS = "ended-ids"

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"
Poison = Callable[[Record, SchemaError], object]
T = TypeVar("T")


def decoded(topic: Topic[T], codec: Codec, records: Iterable[Record],
            poison: Poison, key: str | None = None) -> list[tuple[Record, T]]:
    """The records that decode as ``topic``'s events, with their events, in
    order (a record of many requests' events gives a pair for each, of ``key``'s
    request only when given); each one that does not decode goes to ``poison``."""
    out: list[tuple[Record, T]] = []
    for record in records:
        try:
            events = topic.unpack(codec, record.value)
        except SchemaError as exc:
            poison(record, exc)
            continue
        if key is not None and topic.batch is not None:
            events = [e for e in events if cast(Any, e)["envelope"]["request_id"] == key]
        out.extend((record, event) for event in events)
    return out


def request_ids_header(ids: Iterable[str]) -> tuple[str, bytes]:
    """The header naming the requests whose events a record of many holds."""
    return REQUEST_IDS, ",".join(dict.fromkeys(ids)).encode()


def ended_ids_header(ids: Iterable[str]) -> tuple[str, bytes]:
    """The header naming the requests whose last chunk (an end or an error) a
    conveyor.tokens record holds: what schedule's finish follower reads."""
    return ENDED_IDS, ",".join(dict.fromkeys(ids)).encode()


def ended_ids(record: Record) -> list[bytes] | None:
    """The requests a tokens record ends (None: the record does not say)."""
    for name, value in record.headers or ():
        if name == ENDED_IDS:
            return value.split(b",") if value else []
    return None


def request_ids(record: Record) -> list[bytes]:
    """The requests a record holds events of: those its request-ids header
    names, else its key's."""
    for name, value in record.headers or ():
        if name == REQUEST_IDS:
            return value.split(b",")
    return [record.key] if record.key is not None else []


def holds(record: Record, key: bytes) -> bool:
    """Whether ``record`` is ``key``'s: its key, or a request its
    request-ids header names."""
    return record.key == key or key in request_ids(record)


class PoisonReport:
    """The poison handler of a reader that does not own its records: one
    warning line per ten seconds naming the record, the rest counted."""

    def __init__(self, logger: logging.Logger, topic: Topic[Any]) -> None:
        self.expected = " or ".join(topic.events)
        self._problems = RateLimitedLog(logger)

    def __call__(self, record: Record, exc: SchemaError) -> None:
        self._problems.warning("poison", "%s[%d]@%d: skipping what is not a %s: %s",
                               record.topic, record.partition, record.offset, self.expected,
                               exc)


async def fetch(consumer: Any, backoff: Backoff, problems: RateLimitedLog, who: str,
                *partitions: TopicPartition, **options: Any
                ) -> dict[TopicPartition, list[Record]]:
    """One ``getmany`` of a group consumer; nothing (after the backoff's wait)
    when the broker fails, which is logged, never raised."""
    try:
        batch: dict[TopicPartition, list[Record]] = await consumer.getmany(*partitions,
                                                                          **options)
    except KafkaError as exc:
        problems.warning("fetch", "%s: fetching failed (%s); retrying", who, broker_error(exc))
        await backoff.wait()
        return {}
    backoff.reset()
    return batch

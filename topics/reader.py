"""Reading records as their topic's events: the one fetch step and the one
decode step every Conveyor reader of Kafka shares (the layer runtime, an
infer worker's claim loop, the followers and the keyed lookup).

:func:`fetch` is a consumer's ``getmany`` that waits a failing broker out:
the failure is logged (one line per kind per ten seconds) and the next
fetch comes after :class:`~topics.backoff.Backoff`'s wait, reset by the
first fetch that works. :func:`decoded` turns records into
``(record, event)`` pairs typed by the topic (``Topic[T]`` gives ``T``);
a value that does not decode is handed to ``poison`` and left out, so a
poison event never stops a reader. What ``poison`` does is the reader's
one choice: a consumer group that owns its records dead-letters it
(:func:`workers.failures.failure_outputs`); a reader of records it does
not own (a follower, a lookup) reports it with :class:`PoisonReport`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias, TypeVar

from aiokafka import ConsumerRecord, TopicPartition

from conveyor.errors import SchemaError
from schemas.codec import Codec
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import Topic
from topics.clients import KafkaError, broker_error

__all__ = ["Poison", "PoisonReport", "Record", "decoded", "fetch"]

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"
Poison = Callable[[Record, SchemaError], object]
T = TypeVar("T")


def decoded(topic: Topic[T], codec: Codec, records: Iterable[Record],
            poison: Poison) -> list[tuple[Record, T]]:
    """The records that decode as ``topic``'s events, with their events, in
    order; each one that does not goes to ``poison``."""
    out: list[tuple[Record, T]] = []
    for record in records:
        try:
            out.append((record, topic.decode(codec, record.value)))
        except SchemaError as exc:
            poison(record, exc)
    return out


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

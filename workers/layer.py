"""What a layer is to the runtime that runs it (:mod:`workers.runtime`): the
protocol every layer implements, and the two it may add (it acts on cancels;
it acts on its share of the source's partitions)."""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias, runtime_checkable

from aiokafka import ConsumerRecord, TopicPartition
from opentelemetry.metrics import Meter

from topics.catalog import Topic
from workers.outputs import Output, Sender

__all__ = ["AssignmentAware", "CancelAware", "Instrumented", "Layer", "Record"]

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


class Layer(Protocol):
    """What a layer provides; the runtime does the rest. A layer that subclasses
    it explicitly inherits the defaults of a stateless one."""

    name: str
    source: Topic[Any]  # the topic it consumes, and so the event it handles

    async def start(self, sender: Sender) -> None:
        """Called once before consuming; a layer that produces on its own (not
        only as the result of ``handle``) keeps the sender."""
        return None

    async def stop(self) -> None:
        return None

    async def handle(self, event: Any, record: Record) -> list[Output]:
        """Turn one event into outputs. Raise RequestError to fail the request.
        Work of more than a few milliseconds of CPU goes to a thread
        (``asyncio.to_thread``): the loop serves every other request."""
        ...

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """The offset safe to commit on ``tp`` once everything before
        ``next_offset`` has been handled (a stateful layer may hold it back)."""
        return next_offset

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """The partitions went to another member: forget what was held for them."""
        return None


@runtime_checkable
class AssignmentAware(Protocol):
    """A layer that acts on how many of its source's partitions it holds."""

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """Called with the whole assignment after each rebalance."""
        ...


@runtime_checkable
class CancelAware(Protocol):
    """A layer whose work stops at a cancel: its events of cancelled requests
    are dropped, and it hears of every cancel."""

    def cancel(self, request_id: str) -> None: ...


@runtime_checkable
class Instrumented(Protocol):
    """A layer with gauges of its own (read at each scrape), made on the
    process's meter when its runtime is built."""

    def instrument(self, meter: Meter) -> None: ...

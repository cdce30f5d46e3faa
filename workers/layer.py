"""What a layer is to the runtime that runs it (:mod:`workers.runtime`): the
protocol every layer implements."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition
from opentelemetry.metrics import Meter

from topics.catalog import Topic
from workers.outputs import Output, Sender

__all__ = ["Layer", "Record"]

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


class Layer(Protocol):
    """What a layer provides; the runtime does the rest. A layer that subclasses
    it explicitly inherits the defaults of a stateless one."""

    name: str
    source: Topic[Any]  # the topic it consumes, and so the event it handles
    # its work stops at a cancel: its events of cancelled requests are dropped,
    # and it hears of every cancel (``cancel``)
    cancellable: ClassVar[bool] = False

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

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """Called with the whole assignment after each rebalance."""
        return None

    def instrument(self, meter: Meter) -> None:
        """Make the layer's own gauges (read at each scrape) on the process's
        meter, when its runtime is built."""
        return None

    def cancel(self, request_id: str) -> None:
        """The request was cancelled (a ``cancellable`` layer hears it)."""
        return None


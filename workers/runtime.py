"""The small consumer runtime every layer but infer runs on.

poll -> decode -> handle -> produce -> wait for the acks -> commit. An event
that cannot be decoded, or whose handler fails unexpectedly, goes to
``conveyor.dlq`` with the error and the loop keeps going; a handler's
:class:`RequestError` becomes an error reply to the request's gateway.
Offsets are committed only after every output of the batch is acknowledged,
and a rebalance waits for the batch in hand to finish, so nothing is lost
(at-least-once; handlers are idempotent on request id).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Any, Protocol

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError

from conveyor.errors import RequestError, SchemaError
from conveyor.settings import Settings
from schemas.codec import Codec, EventType, default_codec
from topics.clients import make_consumer, make_producer
from workers.outputs import Output, Sender, error_info

__all__ = ["Layer", "LayerRuntime"]

log = logging.getLogger(__name__)


class Layer(Protocol):
    """What a layer provides; the runtime does the rest."""

    name: str
    source_topic: str
    source_type: EventType

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def handle(self, event: Any, record: ConsumerRecord[bytes, bytes]) -> list[Output]:
        """Turn one event into outputs. Raise RequestError to fail the request."""
        ...

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """The offset safe to commit on ``tp`` once everything before
        ``next_offset`` has been handled (a stateful layer may hold it back)."""
        ...


class _BatchGuard(ConsumerRebalanceListener):
    """Makes a rebalance wait for the batch in hand to be produced and committed."""

    def __init__(self) -> None:
        self.idle = asyncio.Event()
        self.idle.set()

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.idle.wait()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        return None


class LayerRuntime:
    def __init__(
        self, settings: Settings, layer: Layer, codec: Codec | None = None, max_batch: int = 200
    ) -> None:
        self.settings = settings
        self.layer = layer
        self.codec = codec or default_codec()
        self.max_batch = max_batch
        self._stopping = asyncio.Event()
        self._guard = _BatchGuard()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        consumer = make_consumer(self.settings, group=self.settings.group(self.layer.name))
        consumer.subscribe([self.layer.source_topic], listener=self._guard)
        producer = make_producer(self.settings)
        await producer.start()
        await consumer.start()
        sender = Sender(self.settings, producer, self.codec)
        await self.layer.start()
        log.info("%s: consuming %s", self.layer.name, self.layer.source_topic)
        try:
            while not self._stopping.is_set():
                batch = await consumer.getmany(timeout_ms=200, max_records=self.max_batch)
                if not batch:
                    continue
                self._guard.idle.clear()
                try:
                    await self._process(batch, sender)
                    await sender.flush()
                    await self._commit(consumer, batch)
                finally:
                    self._guard.idle.set()
        finally:
            await self.layer.stop()
            await consumer.stop()
            await producer.stop()

    async def _process(
        self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]], sender: Sender
    ) -> None:
        for records in batch.values():
            for record in records:
                await self._handle_one(record, sender)

    async def _handle_one(self, record: ConsumerRecord[bytes, bytes], sender: Sender) -> None:
        layer = self.layer
        try:
            event = self.codec.decode(record.value, layer.source_type)
        except SchemaError as exc:
            log.warning("%s: poison event %s@%d: %s", layer.name, record.topic, record.offset, exc)
            await sender.dead_letter(layer.name, record.topic, record.partition, record.offset,
                                     record.key, record.value, f"SchemaError: {exc}")
            return
        try:
            outputs = await layer.handle(event, record)
        except RequestError as exc:
            await sender.error_reply(event["envelope"], error_info(exc))
            return
        except Exception as exc:  # a bug must not stop the pipeline: keep the event
            log.exception("%s: handler failed on %s@%d", layer.name, record.topic, record.offset)
            await sender.dead_letter(layer.name, record.topic, record.partition, record.offset,
                                     record.key, record.value, traceback.format_exc())
            envelope = event.get("envelope") if isinstance(event, dict) else None
            if envelope:
                failure = RequestError(f"internal error in {layer.name}: {exc}")
                await sender.error_reply(envelope, error_info(failure))
            return
        for out in outputs:
            await sender.send(out)

    async def _commit(
        self, consumer: Any, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        offsets = {
            tp: self.layer.committable(tp, records[-1].offset + 1)
            for tp, records in batch.items()
        }
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved during the batch: the new owner handles the
            # events again, and handlers are idempotent.
            log.warning("%s: commit skipped after a rebalance: %s", self.layer.name, exc)

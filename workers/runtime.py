"""The small consumer runtime every layer but infer runs on.

poll -> decode -> handle -> produce -> wait for the acks -> commit. An event
that cannot be decoded, or whose handler fails unexpectedly, goes to
``conveyor.dlq`` with the error and the loop keeps going; a handler's
:class:`RequestError` becomes an error reply to the request's gateway.
Offsets are committed only after every output of the batch is acknowledged,
and a rebalance waits for the batch in hand to finish, so nothing is lost
(at-least-once; handlers are idempotent on request id). Commits are spaced
by ``commit_interval_ms`` while events keep coming (and made at once when the
partition goes quiet or is revoked): a commit per batch cost a broker round
trip per event under load.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError
from opentelemetry import trace

from conveyor.errors import RequestError, SchemaError
from conveyor.settings import Settings
from conveyor.tracing import layer_span, trace_id_of
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

    async def start(self, sender: Sender) -> None:
        """Called once before consuming; a layer that produces on its own (not
        only as the result of ``handle``) keeps the sender."""
        ...

    async def stop(self) -> None: ...

    async def handle(self, event: Any, record: ConsumerRecord[bytes, bytes]) -> list[Output]:
        """Turn one event into outputs. Raise RequestError to fail the request."""
        ...

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """The offset safe to commit on ``tp`` once everything before
        ``next_offset`` has been handled (a stateful layer may hold it back)."""
        ...

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """The partitions went to another member: forget what was held for them."""
        ...


class _BatchGuard(ConsumerRebalanceListener):
    """Makes a rebalance wait for the batch in hand, then commits what it handled."""

    def __init__(self, runtime: LayerRuntime) -> None:
        self.runtime = runtime
        self.idle = asyncio.Event()
        self.idle.set()

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.idle.wait()
        await self.runtime.commit()
        for tp in revoked:
            self.runtime.handled.pop(tp, None)
        self.runtime.layer.revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        return None


class LayerRuntime:
    def __init__(
        self, settings: Settings, layer: Layer, codec: Codec | None = None, max_batch: int = 200,
        commit_interval_ms: float = 100.0, producer: AIOKafkaProducer | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.layer = layer
        self.codec = codec or default_codec()
        self.max_batch = max_batch
        self.commit_interval_s = commit_interval_ms / 1000
        # layers in one process may share one (started) producer: their events
        # then travel to the broker in the same produce requests
        self._shared_producer = producer
        self.tracer = tracer or trace.NoOpTracer()
        # the offset after the last event handled (and acknowledged) on each partition
        self.handled: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._last_commit = 0.0
        self._consumer: Any = None
        self._stopping = asyncio.Event()
        self._guard = _BatchGuard(self)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        consumer = make_consumer(self.settings, group=self.settings.group(self.layer.name))
        consumer.subscribe([self.layer.source_topic], listener=self._guard)
        producer = self._shared_producer or make_producer(self.settings)
        if self._shared_producer is None:
            await producer.start()
        await consumer.start()
        self._consumer = consumer
        sender = Sender(self.settings, producer, self.codec)
        await self.layer.start(sender)
        log.info("%s: consuming %s", self.layer.name, self.layer.source_topic)
        try:
            while not self._stopping.is_set():
                batch = await consumer.getmany(timeout_ms=200, max_records=self.max_batch)
                if not batch:
                    await self.commit()  # quiet: bring the committed offsets up to date
                    continue
                self._guard.idle.clear()
                try:
                    await self._process(batch, sender)
                    await sender.flush()
                    for tp, records in batch.items():
                        self.handled[tp] = records[-1].offset + 1
                    if time.monotonic() - self._last_commit >= self.commit_interval_s:
                        await self.commit()
                finally:
                    self._guard.idle.set()
            await self.commit()
        finally:
            await self.layer.stop()
            await consumer.stop()
            if self._shared_producer is None:
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
        envelope = event["envelope"]
        try:
            with layer_span(self.tracer, layer.name, envelope):
                outputs = await layer.handle(event, record)
        except RequestError as exc:
            await sender.error_reply(envelope, error_info(exc))
            return
        except Exception as exc:  # a bug must not stop the pipeline: keep the event
            log.exception("%s: handler failed on %s@%d (request %s, trace %s)", layer.name,
                          record.topic, record.offset, envelope["request_id"],
                          trace_id_of(envelope))
            await sender.dead_letter(layer.name, record.topic, record.partition, record.offset,
                                     record.key, record.value, traceback.format_exc())
            failure = RequestError(f"internal error in {layer.name}: {exc}")
            await sender.error_reply(envelope, error_info(failure))
            return
        for out in outputs:
            await sender.send(out)

    async def commit(self) -> None:
        """Commit, for every partition, what the layer says is safe of what was handled."""
        self._last_commit = time.monotonic()
        offsets = {tp: self.layer.committable(tp, nxt) for tp, nxt in self.handled.items()}
        offsets = {tp: o for tp, o in offsets.items() if self._committed.get(tp) != o}
        if not offsets or self._consumer is None:
            return
        try:
            await self._consumer.commit(offsets)
            self._committed.update(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The partitions moved: the new owner handles the events again, and
            # handlers are idempotent.
            log.warning("%s: commit skipped after a rebalance: %s", self.layer.name, exc)

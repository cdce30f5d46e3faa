"""The small consumer runtime every layer but infer runs on: poll -> decode ->
handle -> produce -> wait for the acks -> commit, for several events at once
(docs/decisions/0004-many-requests-per-layer.md).

- Events of one key (a request id) are handled in offset order, different
  keys side by side (``max_concurrency`` at a time); a partition with
  ``max_in_flight`` unfinished events is paused.
- An offset is committed only below the lowest unfinished event of its
  partition and never past ``Layer.committable``; commits are spaced by
  ``commit_interval_ms``, and a rebalance waits (bounded) for the revoked
  partitions' events.
- Every failure to decode, handle, encode or produce an event ends in
  ``conveyor.dlq`` plus an error reply (workers/failures.py); a handler's
  :class:`RequestError` is an error reply alone; passing broker trouble is
  retried with backoff, never dead-lettered.
- A ``cancellable`` layer drops the events of cancelled requests and hears of
  each cancel (workers/cancels.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

from aiokafka import TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from opentelemetry import trace

from conveyor.errors import (
    PermanentBrokerError,
    RequestError,
    SchemaError,
    StartupTimeout,
    TransientBrokerError,
)
from conveyor.metrics import LayerMetrics, partition_lag
from conveyor.settings import Settings
from conveyor.startup import kafka_address, started
from schemas.codec import Codec, default_codec
from schemas.records import Envelope
from topics.backoff import Backoff, RateLimitedLog
from topics.clients import (
    COMMIT_REFUSED,
    KafkaError,
    NotAssigned,
    broker_error,
    make_consumer,
    make_producer,
    stop_consumer,
)
from topics.producer import Producer
from topics.reader import fetch
from topics.tracing import layer_span, trace_id_of
from workers.cancels import CancelList
from workers.failures import failure_outputs
from workers.inflight import PartitionBook
from workers.layer import Layer, Record
from workers.outputs import Output, Sender, failure_reply

__all__ = ["LayerRuntime"]

log = logging.getLogger(__name__)


class _Abandoned(Exception):
    """The runtime stops while an event waits on a broker: it stays uncommitted."""


class _Rebalance(ConsumerRebalanceListener):
    """Makes a rebalance wait for the revoked partitions' events, then commits."""

    def __init__(self, runtime: LayerRuntime) -> None:
        self.runtime = runtime

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.runtime.settle(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.runtime.layer.assigned(list(assigned))


class LayerRuntime:
    def __init__(
        self, settings: Settings, layer: Layer, codec: Codec | None = None,
        max_in_flight: int = 256, max_concurrency: int = 64,
        commit_interval_ms: float = 100.0, producer: Producer | None = None,
        tracer: trace.Tracer | None = None, cancels: CancelList | None = None,
        settle_timeout_s: float = 20.0, metrics: LayerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.layer = layer
        self.codec = codec or default_codec()
        self.max_in_flight = max_in_flight
        self.commit_interval_s = commit_interval_ms / 1000
        self.settle_timeout_s = settle_timeout_s
        # layers in one process may share one (started) producer: their events
        # then travel to the broker in the same produce requests
        self._shared_producer = producer
        self.tracer = tracer or trace.NoOpTracer()
        self.cancels = cancels
        self._batched = layer.source.batch is not None
        self._own_cancels = cancels is None and layer.cancellable
        if self._own_cancels:
            self.cancels = CancelList(settings, self.codec)
        self.partitions: dict[TopicPartition, PartitionBook] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._last_commit = 0.0
        self._consumer: Any = None
        self._sender: Sender | None = None
        self._stopping = asyncio.Event()
        self._progress = asyncio.Event()
        self.ready = asyncio.Event()  # set once the layer consumes
        self._slots = asyncio.Semaphore(max_concurrency)
        # (partition, key) -> the events of that key waiting, and the task handling them
        self._queues: dict[tuple[TopicPartition, object], deque[Record]] = {}
        self._drainers: dict[tuple[TopicPartition, object], asyncio.Task[None]] = {}
        self._paused: set[TopicPartition] = set()
        self._problems = RateLimitedLog(log)
        self.probe = (metrics or LayerMetrics.off()).layer(layer.name, self.lag)
        if metrics is not None:
            layer.instrument(metrics.meter)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        consumer = make_consumer(self.settings.kafka,
                                 group=self.settings.kafka.group(self.layer.name))
        source = self.layer.source.at(self.settings.kafka)
        consumer.subscribe([source], listener=_Rebalance(self))
        producer = self._shared_producer or make_producer(self.settings.kafka)
        background: list[asyncio.Task[None]] = []
        kafka = kafka_address(self.settings.kafka.bootstrap)
        within = self.settings.process.startup_timeout_s
        if self._shared_producer is None:
            await started("the Kafka producer to connect", producer.start, within=within,
                          log=log, where=kafka)
        try:
            await started(f"consumer group {self.settings.kafka.group(self.layer.name)} to assign "
                          f"partitions of {source}", consumer.start,
                          within=within, log=log, where=kafka)
        except StartupTimeout:
            await stop_consumer(consumer, within=5.0)  # its JoinGroup may be in flight
            raise
        self._consumer = consumer
        sender = self._sender = Sender(self.settings, producer, self.codec)
        if self.cancels is not None and self.layer.cancellable:
            self.cancels.subscribe(self.layer.cancel)
            if self._own_cancels:
                background.append(asyncio.create_task(self.cancels.run(), name="cancels"))
        try:
            await started(f"the {self.layer.name} layer to start", lambda: self.layer.start(sender),
                          within=within, log=log)
            log.info("%s: consuming %s", self.layer.name, source)
            self.ready.set()
            await self._loop(consumer)
            await self._wait_while(lambda: bool(self._drainers))
            await self.commit()
        finally:
            for task in [*background, *self._drainers.values()]:
                task.cancel()
            await self.layer.stop()
            await consumer.stop()
            if self._shared_producer is None:
                await producer.stop()

    async def _loop(self, consumer: Any) -> None:
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        while not self._stopping.is_set():
            batch = await fetch(consumer, backoff, self._problems, self.layer.name,
                                timeout_ms=200, max_records=self.max_in_flight)
            for records in batch.values():
                for record in records:
                    self._dispatch(record)
            self._pause_full()
            if not batch or time.monotonic() - self._last_commit >= self.commit_interval_s:
                await self.commit()

    def _dispatch(self, record: Record) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self.partitions.setdefault(tp, PartitionBook()).take(record.offset)
        # a record of many requests' events is handled in its partition's order
        key = (tp, None if self._batched else
               record.key if record.key is not None else record.offset)
        queue = self._queues.get(key)
        if queue is not None:
            queue.append(record)
            return
        self._queues[key] = deque([record])
        self._drainers[key] = asyncio.create_task(self._drain(key), name=f"{self.layer.name}")

    async def _drain(self, key: tuple[TopicPartition, object]) -> None:
        queue = self._queues[key]
        try:
            while queue:
                record = queue[0]
                try:
                    async with self._slots:
                        started = time.perf_counter()
                        await self._handle_record(record)
                        self.probe.handled(time.perf_counter() - started)
                except _Abandoned:
                    return  # uncommitted: handled again after the restart
                except Exception:  # a bug of the runtime itself: never a stuck partition
                    log.exception("%s: failed on %s@%d", self.layer.name, record.topic,
                                  record.offset)
                queue.popleft()
                self._finished(record)
        finally:
            self._queues.pop(key, None)
            self._drainers.pop(key, None)
            self._progress.set()

    def _finished(self, record: Record) -> None:
        tp = TopicPartition(record.topic, record.partition)
        part = self.partitions.get(tp)
        if part is not None:
            part.finish(record.offset)
            if tp in self._paused and part.pending < self.max_in_flight:
                self._paused.discard(tp)
                with contextlib.suppress(NotAssigned):
                    self._consumer.resume(tp)
        self._progress.set()

    def _pause_full(self) -> None:
        for tp, part in self.partitions.items():
            if tp not in self._paused and part.pending >= self.max_in_flight:
                self._paused.add(tp)
                with contextlib.suppress(NotAssigned):
                    self._consumer.pause(tp)

    def lag(self) -> list[tuple[int, int]]:
        """(partition, events in its log not taken yet), for the metrics."""
        return partition_lag(self._consumer,
                             {tp: part.next for tp, part in list(self.partitions.items())})

    async def _handle_record(self, record: Record) -> None:
        """Decode, handle and produce one record's events (several requests'
        on a topic of batches), their outputs produced together; every failure
        ends in the DLQ and an error reply, or (passing broker trouble) in a retry."""
        layer = self.layer
        try:
            events = layer.source.unpack(self.codec, record.value)
        except SchemaError as exc:
            log.warning("%s: poison event %s@%d: %s", layer.name, record.topic, record.offset, exc)
            await self._fail(record, None, exc, f"SchemaError: {exc}")
            return
        outputs: list[Output] = []
        envelopes: list[Envelope | None] = []
        for event in events:
            # job events (commands, results) belong to a job, not to one request
            envelope: Envelope | None = event.get("envelope")
            if (self.cancels is not None and layer.cancellable and envelope
                    and envelope["request_id"] in self.cancels):
                log.info("%s: request %s was cancelled; dropping its event", layer.name,
                         envelope["request_id"])
                continue
            handled = await self._outputs(event, envelope, record)
            if handled:
                outputs.extend(handled)
                envelopes.append(envelope)
        if not outputs:
            return
        try:
            await self._produce(outputs)
        except (PermanentBrokerError, SchemaError) as exc:
            envelope = envelopes[0] if len(envelopes) == 1 else None
            log.error("%s: cannot produce the outputs of %s@%d (request %s, trace %s): %s",
                      layer.name, record.topic, record.offset, _rid(envelope),
                      _trace(envelope), exc)
            await self._fail(record, envelopes[0], exc, f"{type(exc).__name__}: {exc}")
            for other in envelopes[1:]:  # one letter of the record, a reply to each request
                replies = self._sender_().error_outputs(
                    other, failure_reply(exc, layer.name)) if other else []
                with contextlib.suppress(PermanentBrokerError, SchemaError):
                    await self._produce(replies)

    async def _outputs(self, event: Any, envelope: Envelope | None, record: Record
                       ) -> list[Output] | None:
        """The handler's outputs (an error reply for a RequestError), or None
        when the event went to the DLQ."""
        layer = self.layer
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        while True:
            try:
                if envelope is None:
                    return await layer.handle(event, record)
                with layer_span(self.tracer, layer.name, envelope):
                    return await layer.handle(event, record)
            except RequestError as exc:
                if envelope is None:  # no request to fail: keep the event in the DLQ
                    await self._fail(record, None, exc, f"{type(exc).__name__}: {exc}")
                    return None
                generation = event.get("generation") if isinstance(event, dict) else None
                return self._sender_().error_outputs(envelope, exc, generation)
            except (TransientBrokerError, KafkaError) as exc:
                translated = broker_error(exc)
                if not isinstance(translated, TransientBrokerError):
                    await self._fail(record, envelope, translated, traceback.format_exc())
                    return None
                if self._stopping.is_set():
                    raise _Abandoned() from exc
                self._problems.warning(f"handle:{type(exc).__name__}",
                                       "%s: the broker failed under the handler (%s); retrying",
                                       layer.name, translated)
                await backoff.wait()
            except Exception as exc:  # a bug must not stop the pipeline: keep the event
                log.exception("%s: handler failed on %s@%d (request %s, trace %s)", layer.name,
                              record.topic, record.offset, _rid(envelope), _trace(envelope))
                await self._fail(record, envelope, exc, traceback.format_exc())
                return None

    async def _produce(self, outputs: list[Output]) -> None:
        try:
            await self._sender_().produce(outputs, self._stopping)
        except TransientBrokerError as exc:  # only when stopping
            raise _Abandoned() from exc

    async def _fail(self, record: Record, envelope: Envelope | None, exc: BaseException,
                    detail: str) -> None:
        """Dead-letter the event (never one of the DLQ itself) and, when it belongs
        to a request, fail it: workers/failures.py."""
        sender = self._sender_()
        for out in failure_outputs(sender, self.layer.name, record, envelope, exc, detail):
            if out.event_type == "DeadLetter":
                self.probe.dead_letter()
            try:
                await self._produce([out])
            except (PermanentBrokerError, SchemaError) as again:
                log.error("%s: cannot produce the %s for %s@%d either: %s", self.layer.name,
                          out.event_type, record.topic, record.offset, again)

    def _sender_(self) -> Sender:
        assert self._sender is not None, "the runtime has not started"
        return self._sender

    async def commit(self) -> None:
        """Commit, for every partition, what the layer says is safe below the
        lowest unfinished event."""
        self._last_commit = time.monotonic()
        offsets = {tp: self.layer.committable(tp, part.low())
                   for tp, part in self.partitions.items()}
        offsets = {tp: o for tp, o in offsets.items() if self._committed.get(tp) != o}
        if not offsets or self._consumer is None:
            return
        try:
            await self._consumer.commit(offsets)
            self._committed.update(offsets)
        except COMMIT_REFUSED as exc:
            # The partitions moved: the new owner handles the events again, and
            # handlers are idempotent.
            log.warning("%s: commit skipped after a rebalance: %s", self.layer.name, exc)
        except KafkaError as exc:  # tried again at the next commit
            self._problems.warning("commit", "%s: commit failed for now: %s", self.layer.name,
                                   broker_error(exc))

    async def settle(self, revoked: list[TopicPartition]) -> None:
        """Wait (bounded) for the revoked partitions' events, commit, forget them."""
        gone = set(revoked)
        await self._wait_while(lambda: any(k[0] in gone for k in self._drainers))
        for key, task in list(self._drainers.items()):
            if key[0] in gone:
                task.cancel()  # still waiting on a broker: the new owner takes it again
        await self.commit()
        for tp in gone:
            self.partitions.pop(tp, None)
            self._committed.pop(tp, None)
            self._paused.discard(tp)
        self.layer.revoked(list(revoked))

    async def _wait_while(self, busy: Callable[[], bool]) -> None:
        """Wait while ``busy()``, at most ``settle_timeout_s``."""
        deadline = time.monotonic() + self.settle_timeout_s
        while busy() and time.monotonic() < deadline:
            self._progress.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), 0.5)


def _rid(envelope: Envelope | None) -> str:
    return envelope["request_id"] if envelope is not None else "-"


def _trace(envelope: Envelope | None) -> str:
    return trace_id_of(envelope) if envelope is not None else "-"

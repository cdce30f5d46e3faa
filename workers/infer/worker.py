"""An infer worker: one engine, one member of its pool's consumer group.

It takes tasks from the partitions the group gives it, never more at once
than the engine's capacity (partitions are paused while it is full), streams
each generation to ``conveyor.tokens``, and commits a task's offset only when
its generation has ended. It heartbeats its partitions and load to
``conveyor.workers`` and stops a generation when a cancel arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import traceback

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from opentelemetry import trace

from conveyor.errors import SchemaError
from conveyor.registry import Registry
from conveyor.settings import Settings
from conveyor.tracing import layer_span, trace_id_of
from schemas.codec import Codec, default_codec
from topics.catalog import infer_topic
from topics.clients import make_consumer, make_producer
from workers.infer.cancels import CancelFollower
from workers.infer.engines.base import Engine
from workers.infer.generation import TaskRun
from workers.infer.heartbeat import Heartbeat
from workers.infer.offsets import InFlightOffsets
from workers.infer.progress import ProgressTracker
from workers.outputs import Sender

__all__ = ["InferWorker"]

log = logging.getLogger(__name__)


class _Assignment(ConsumerRebalanceListener):
    def __init__(self, worker: InferWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.worker.hand_off(set(revoked))
        await self.worker.commit()
        self.worker.offsets.forget(list(revoked))
        self.worker.partitions -= set(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.worker.partitions |= set(assigned)
        self.worker.beat_soon()


class InferWorker:
    def __init__(self, settings: Settings, engine: Engine, pool: str, registry: Registry,
                 worker_id: str | None = None, codec: Codec | None = None,
                 drain_timeout_s: float = 30.0, tracer: trace.Tracer | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.pool = pool
        self.registry = registry
        self.worker_id = worker_id or f"{pool}-{os.uname().nodename}-{os.getpid()}"
        self.codec = codec or default_codec()
        self.drain_timeout_s = drain_timeout_s
        self.tracer = tracer or trace.NoOpTracer()
        self.partitions: set[TopicPartition] = set()
        self.offsets = InFlightOffsets()
        self.running: dict[str, TaskRun] = {}
        self._where: dict[str, tuple[TopicPartition, asyncio.Task[None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._commit_lock = asyncio.Lock()
        self._commit_due = asyncio.Event()
        self.commit_interval_s = 0.1

    def stop(self) -> None:
        self._stopping.set()

    def beat_soon(self) -> None:
        self._beat_now.set()

    def models(self) -> list[str]:
        return sorted(m.name for m in self.registry.models.values() if m.pool == self.pool)

    async def run(self) -> None:
        await self.engine.start()
        producer = make_producer(self.settings)
        await producer.start()
        redis = aioredis.from_url(self.settings.redis_url)
        sender = Sender(self.settings, producer, self.codec)
        store = ProgressTracker(self.settings, redis, self.codec, producer)
        heartbeat = Heartbeat(self.settings, sender, self.worker_id, self.pool, self.engine.name,
                              self.models(), self.engine.capacity, self._snapshot)
        cancels = CancelFollower(self.settings, self.codec, self._on_cancel)
        consumer = make_consumer(self.settings, group=self.settings.group(f"infer.{self.pool}"))
        consumer.subscribe([infer_topic(self.settings, self.pool)],
                           listener=_Assignment(self))
        self._consumer = consumer
        background: list[asyncio.Task[None]] = [
            asyncio.create_task(cancels.run(), name="cancels"),
            asyncio.create_task(self._beat_loop(heartbeat), name="heartbeat"),
            asyncio.create_task(self._commit_loop(), name="commits"),
            asyncio.create_task(self._lease_loop(store), name="leases"),
        ]
        await consumer.start()
        log.info("worker %s: serving pool %s with %s (capacity %d)", self.worker_id, self.pool,
                 self.engine.name, self.engine.capacity)
        try:
            await self._consume(consumer, sender, store, background)
            await self._drain(heartbeat)
        finally:
            for task in background:
                task.cancel()
            for task in self._tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                heartbeat.state = "stopped"
                await heartbeat.beat()
            await consumer.stop()
            await producer.stop()
            await redis.aclose()
            await self.engine.close()

    async def _consume(self, consumer: AIOKafkaConsumer, sender: Sender, store: ProgressTracker,
                       background: list[asyncio.Task[None]]) -> None:
        while not self._stopping.is_set():
            for task in background:
                if task.done():
                    task.result()  # a failed background concern surfaces here
            free = self.engine.capacity - len(self.running)
            if free <= 0:
                consumer.pause(*consumer.assignment())
                self._slot_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), 1.0)
                continue
            if consumer.paused():
                consumer.resume(*consumer.paused())
            batch = await consumer.getmany(timeout_ms=200, max_records=free)
            for tp, records in batch.items():
                for record in records:
                    await self._take(tp, record, sender, store)

    async def _take(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes],
                    sender: Sender, store: ProgressTracker) -> None:
        try:
            task = self.codec.decode(record.value, "Task")
        except SchemaError as exc:
            await sender.dead_letter("infer", record.topic, record.partition, record.offset,
                                     record.key, record.value, f"SchemaError: {exc}")
            self._done(tp, record.offset, self.offsets.start(tp, record.offset))
            return
        spec = self.registry.find(task["route"]["model"])
        gen = TaskRun(self.settings, self.engine, sender, store, self.worker_id, task,
                         upstream_model=spec.upstream_model if spec else None)
        rid = gen.request_id
        epoch = self.offsets.start(tp, record.offset)
        self.running[rid] = gen
        job = asyncio.create_task(self._generate(gen, tp, record, epoch), name=f"gen-{rid}")
        self._where[rid] = (tp, job)
        self._tasks.add(job)
        job.add_done_callback(self._tasks.discard)

    async def hand_off(self, revoked: set[TopicPartition], timeout_s: float = 10.0) -> None:
        """Stop the generations of revoked partitions, once their chunks are in the
        log: the partitions' new owner continues them (instead of both generating)."""
        jobs = []
        for rid, (tp, job) in list(self._where.items()):
            if tp in revoked and rid in self.running:
                self.running[rid].handoff()
                jobs.append(job)
        if jobs:
            log.info("worker %s: handing off %d generation(s)", self.worker_id, len(jobs))
            await asyncio.wait(jobs, timeout=timeout_s)

    async def _generate(self, gen: TaskRun, tp: TopicPartition,
                        record: ConsumerRecord[bytes, bytes], epoch: int) -> None:
        try:
            with layer_span(self.tracer, "infer", gen.task["envelope"]) as span:
                await gen.run()
                span.set_attribute("conveyor.completion_tokens", gen.tokens)
                span.set_attribute("conveyor.worker_id", self.worker_id)
        except Exception:
            # Not a request failure the engine reported: keep the task for the record.
            log.exception("worker %s: generation %s failed (trace %s)", self.worker_id,
                          gen.request_id, trace_id_of(gen.task["envelope"]))
            with contextlib.suppress(Exception):
                await gen.sender.dead_letter("infer", record.topic, record.partition,
                                             record.offset, record.key, record.value,
                                             traceback.format_exc())
        finally:
            self.running.pop(gen.request_id, None)
            self._where.pop(gen.request_id, None)
            if gen.handed_off:
                self._slot_freed.set()  # not done: its offset stays for the new owner
            else:
                self._done(tp, record.offset, epoch)

    def _done(self, tp: TopicPartition, offset: int, epoch: int) -> None:
        self.offsets.finish(tp, offset, epoch)
        self._slot_freed.set()
        self._commit_due.set()

    async def _lease_loop(self, store: ProgressTracker) -> None:
        """Renew the leases of the running tasks, so no other worker takes them over."""
        while True:
            await asyncio.sleep(self.settings.claim_lease_s / 4)
            await store.keep([rid for rid, run in self.running.items() if run.leased],
                             self.worker_id)

    async def _commit_loop(self) -> None:
        """Commit finished tasks at most every ``commit_interval_s`` (one round trip
        a task cost the broker more than the task's own events)."""
        while True:
            await self._commit_due.wait()
            await asyncio.sleep(self.commit_interval_s)
            self._commit_due.clear()
            await self.commit()

    async def commit(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        async with self._commit_lock:
            offsets = {tp: off for tp, off in self.offsets.committable().items()
                       if tp in self.partitions}
            if not offsets:
                return
            try:
                await consumer.commit(offsets)
            except (CommitFailedError, IllegalStateError, KafkaError) as exc:
                log.warning("worker %s: commit skipped: %s", self.worker_id, exc)

    def _on_cancel(self, request_id: str) -> None:
        gen = self.running.get(request_id)
        if gen is not None:
            gen.cancelled = True

    def _snapshot(self) -> tuple[list[int], int, int]:
        return [tp.partition for tp in self.partitions], len(self.running), 0

    async def _beat_loop(self, heartbeat: Heartbeat) -> None:
        while True:
            await heartbeat.beat()
            self._beat_now.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.settings.heartbeat_interval_s)

    async def _drain(self, heartbeat: Heartbeat) -> None:
        """Stop taking tasks, let the running ones end (bounded), commit them."""
        heartbeat.state = "draining"
        with contextlib.suppress(Exception):
            await heartbeat.beat()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.drain_timeout_s)
        await self.commit()

"""An infer worker: one engine, one member of its pool's consumer group.

It takes tasks from the partitions the group gives it, never more at once
than the engine's capacity (partitions are paused while it is full), streams
each generation to ``conveyor.tokens``, and commits a task's offset only when
its generation has ended and every chunk of it is acknowledged. It heartbeats
its partitions and load to ``conveyor.workers`` and stops a generation at a
cancel (the cancels of the last ``request_timeout_s`` are read at start, so a
task taken after its cancel is never generated) or when its gateway is gone
(workers/infer/gateways.py). Every background concern waits out Redis and
Kafka outages with backoff; a generation whose chunks Kafka did not
acknowledge is run again from the log until its deadline. A rebalance stops
only the generations of partitions that went to another member, which
continues them (docs/decisions/0022-infer-failover.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from opentelemetry import trace

from conveyor.errors import BrokerError, SchemaError, TransientBrokerError
from conveyor.metrics import partition_lag
from conveyor.redis_clients import REDIS_ERRORS, REDIS_REFUSALS, redis_client
from conveyor.registry import Registry
from conveyor.settings import Settings
from conveyor.startup import kafka_address, redis_address, started
from schemas.codec import default_codec
from topics.backoff import Backoff, RateLimitedLog, retry_every
from topics.catalog import INFER, infer_topic
from topics.clients import (
    COMMIT_REFUSED,
    KafkaError,
    make_consumer,
    make_producer,
    stop_consumer,
)
from topics.envelope import PRIORITY_INTERACTIVE, now_ms
from topics.lookup import SharedLookup
from topics.reader import fetch
from topics.tracing import layer_span, trace_id_of
from workers.cancels import CancelList
from workers.failures import dead_letter
from workers.infer.assignor import BusyAwareAssignor
from workers.infer.engines.base import Engine
from workers.infer.gateways import GatewayWatch
from workers.infer.generation import TaskRun
from workers.infer.heartbeat import Heartbeat, Snapshot, Speed
from workers.infer.progress import ProgressTracker
from workers.infer.token_records import TokenRecords
from workers.inflight import InFlightOffsets
from workers.outputs import Sender
from workers.prefix import HeldBlocks

__all__ = ["InferWorker"]

log = logging.getLogger(__name__)

# what a background concern may meet and wait out
_TRANSIENT = (KafkaError, *REDIS_ERRORS, BrokerError, asyncio.TimeoutError)
_BEAT_TIMEOUT_S = 5.0
_DRAIN_TIMEOUT_S = 30.0  # how long a stopping worker lets its generations run on


@dataclass
class _Running:
    """One task in progress and the task records (offsets) it answers for."""

    run: TaskRun
    job: asyncio.Task[None]
    bookings: list[tuple[TopicPartition, int, int]] = field(default_factory=list)


class _Rebalance(ConsumerRebalanceListener):
    """Commits what finished before partitions are revoked; hands off the
    generations of partitions that went to another member."""

    def __init__(self, worker: InferWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        worker = self.worker
        worker.owned_before = set(worker.partitions)
        await worker.commit()
        worker.offsets.forget(list(revoked))
        worker.partitions -= set(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.worker.partitions |= set(assigned)
        await self.worker.hand_off_unassigned()
        self.worker.beat_soon()


class InferWorker:
    def __init__(self, settings: Settings, engine: Engine, pool: str, registry: Registry,
                 worker_id: str | None = None, tracer: trace.Tracer | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.pool = pool
        self.registry = registry
        self.worker_id = worker_id or f"{pool}-{os.uname().nodename}-{os.getpid()}"
        self.codec = default_codec()
        self.tracer = tracer or trace.NoOpTracer()
        self.dead_lettered: Callable[[], None] = lambda: None  # metrics count each letter
        self.interactive_ms = 0  # when the last interactive task was taken (heartbeats)
        self.speed = Speed()  # measured from its generations (heartbeats)
        # the prompt blocks its engine's cache holds, as far as it can tell (heartbeats)
        self.held = HeldBlocks(settings.prefix.report_blocks)
        self.partitions: set[TopicPartition] = set()
        # what this worker owned when the last rebalance began (the assignor keeps it)
        self.owned_before: set[TopicPartition] = set()
        self.offsets = InFlightOffsets()
        self.running: dict[str, _Running] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once the worker serves its pool
        self._beat_now = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._joined = False  # the consumer's start (its group join) finished
        self._commit_lock = asyncio.Lock()
        self._commit_due = asyncio.Event()
        self.commit_interval_s = 0.1
        self._cancels: CancelList | None = None
        self._taken: dict[TopicPartition, int] = {}  # the next offset to take (metrics)
        self._problems = RateLimitedLog(log)

    def stop(self) -> None:
        self._stopping.set()

    def beat_soon(self) -> None:
        self._beat_now.set()

    def models(self) -> list[str]:
        """The models this worker serves: its engine's (a model set's), else its
        pool's."""
        served = self.engine.served
        if served is not None:
            return sorted(served)
        return sorted(m.name for m in self.registry.models.values() if m.pool == self.pool)

    async def run(self) -> None:
        kafka = kafka_address(self.settings.kafka.bootstrap)
        within = self.settings.process.startup_timeout_s
        async with contextlib.AsyncExitStack() as stack:  # what started stops, in reverse
            await started(f"the {self.engine.name} engine to start", self.engine.start,
                          within=None, log=log)  # a model loads as long as it takes: no bound
            stack.push_async_callback(self.engine.close)
            producer = make_producer(self.settings.kafka)
            stack.push_async_callback(producer.stop)
            await started("the Kafka producer to connect", producer.start, within=within,
                          log=log, where=kafka)
            redis = redis_client(self.settings.redis, "claims")
            stack.push_async_callback(redis.aclose)
            await started("Redis to answer (task claims)", redis.ping, within=within, log=log,
                          where=redis_address(self.settings.redis.url), retry_on=REDIS_REFUSALS)
            sender = Sender(self.settings, producer, self.codec)
            # every run's chunks, one record a partition a tick
            records = TokenRecords(self.settings, sender, lambda: len(self.running))
            records.start()
            stack.push_async_callback(records.close)
            # the worker's one keyed reader of the log
            lookup = SharedLookup(self.settings, codec=self.codec)
            stack.push_async_callback(lookup.close)
            store = ProgressTracker(self.settings, redis, lookup)
            heartbeat = Heartbeat(self.settings, sender, self.worker_id, self.pool, self.engine,
                                  self.models(), self._snapshot, self.held, self.speed)
            self._cancels = CancelList(self.settings, self.codec)
            self._cancels.subscribe(self._on_cancel)
            # the infer group's short session timeout and the busy-aware assignor alone
            # (why alone: docs/decisions/0022-infer-failover.md)
            group, topic = self.settings.kafka.group(f"infer.{self.pool}"), infer_topic(
                self.settings.kafka, self.pool)
            consumer = self._consumer = make_consumer(
                self.settings.kafka, group=group, client_id=self.worker_id,
                session_timeout_ms=self.settings.infer.session_timeout_ms,
                heartbeat_interval_ms=self.settings.infer.heartbeat_interval_ms,
                partition_assignment_strategy=(BusyAwareAssignor(self.assignor_state),))
            consumer.subscribe([topic], listener=_Rebalance(self))
            stack.push_async_callback(self._leave, consumer)
            background = self._background(self._cancels, heartbeat, store,
                                          GatewayWatch(self.settings, redis))
            stack.push_async_callback(self._stop_background, background, heartbeat)
            await started(f"consumer group {group} to assign partitions of {topic}",
                          consumer.start, within=within, log=log, where=kafka)
            self._joined = True
            log.info("worker %s: serving pool %s with %s (capacity %d)", self.worker_id,
                     self.pool, self.engine.name, self.engine.capacity)
            self.ready.set()
            await self._consume(consumer, records, store, background)
            await self._drain(heartbeat)

    async def _leave(self, consumer: AIOKafkaConsumer) -> None:
        """Stop the consumer; one still joining its group (start-up gave up) is cut short."""
        await stop_consumer(consumer, None if self._joined else _BEAT_TIMEOUT_S)

    async def _stop_background(self, background: list[asyncio.Task[None]],
                               heartbeat: Heartbeat) -> None:
        for task in [*background, *self._tasks]:
            task.cancel()
        with contextlib.suppress(Exception):
            heartbeat.state = "stopped"
            await asyncio.wait_for(heartbeat.beat(), _BEAT_TIMEOUT_S)

    def _background(self, cancels: CancelList, heartbeat: Heartbeat, store: ProgressTracker,
                    gateways: GatewayWatch) -> list[asyncio.Task[None]]:
        """The worker's background concerns, each retrying Redis and Kafka on its own."""
        backoff = self.settings.process.retry_backoff_max_s

        def every(name: str, step: Callable[[], Awaitable[None]],
                  every_s: float) -> asyncio.Task[None]:
            return asyncio.create_task(retry_every(name, step, every_s, backoff, _TRANSIENT, log),
                                       name=name)

        return [asyncio.create_task(cancels.run(), name="cancels"),
                every("heartbeat", lambda: self._beat(heartbeat), 0.0),
                asyncio.create_task(self._commit_loop(), name="commits"),
                every("leases", lambda: self._keep_leases(store),
                      self.settings.infer.claim_lease_s / 5),
                every("gateways", lambda: gateways.check(self._runs()),
                      self.settings.gateway.reply_lease_ttl_s / 3)]

    async def _consume(self, consumer: AIOKafkaConsumer, records: TokenRecords,
                       store: ProgressTracker,
                       background: list[asyncio.Task[None]]) -> None:
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
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
            batch = await fetch(consumer, backoff, self._problems, f"worker {self.worker_id}",
                                timeout_ms=200, max_records=free)
            for tp, taken in batch.items():
                for record in taken:
                    await self._take(tp, record, records, store)

    async def _take(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes],
                    records: TokenRecords, store: ProgressTracker) -> None:
        try:
            task = INFER.decode(self.codec, record.value)
        except SchemaError as exc:  # poison: the runtime's path (workers/failures.py)
            log.warning("worker %s: poison event %s[%d]@%d: %s", self.worker_id, record.topic,
                        record.partition, record.offset, exc)
            try:
                await dead_letter(records.sender, "infer", record, exc, self._stopping)
            except TransientBrokerError:
                return  # stopping before the letter was taken: read again after a restart
            self.dead_lettered()
            self._done(tp, record.offset, self.offsets.start(tp, record.offset))
            return
        rid = task["envelope"]["request_id"]
        if task["envelope"]["priority"] == PRIORITY_INTERACTIVE:
            self.interactive_ms = now_ms()
        self._taken[tp] = record.offset + 1
        epoch = self.offsets.start(tp, record.offset)
        same = self.running.get(rid)
        if same is not None:
            # this worker runs the request already (its partition came back after a
            # rebalance, or the task was delivered twice): that run answers for it
            same.bookings.append((tp, record.offset, epoch))
            return
        self.held.took(task["prompt"]["prefix_blocks"])
        spec = self.registry.find(task["route"]["model"])
        gen = TaskRun(self.settings, self.engine, store, self.worker_id, task, records,
                      upstream_model=spec.upstream_model if spec else None,
                      written_ms=record.timestamp, speed=self.speed)
        if self._cancels is not None and rid in self._cancels:
            gen.cancelled = True  # cancelled while it waited: never generated
        job = asyncio.create_task(self._generate(gen, record), name=f"gen-{rid}")
        self.running[rid] = _Running(gen, job, [(tp, record.offset, epoch)])
        self._tasks.add(job)
        job.add_done_callback(self._tasks.discard)

    async def hand_off_unassigned(self, timeout_s: float = 10.0) -> None:
        """Stop the generations whose partitions went to another worker, once their
        chunks are in the log: the new owner continues them (instead of both
        generating). Those whose partitions came back keep going."""
        jobs = []
        for running in list(self.running.values()):
            if not any(tp in self.partitions for tp, _, _ in running.bookings):
                running.run.handed_off = True
                jobs.append(running.job)
        if jobs:
            log.info("worker %s: handing off %d generation(s)", self.worker_id, len(jobs))
            await asyncio.wait(jobs, timeout=timeout_s)

    async def _generate(self, gen: TaskRun, record: ConsumerRecord[bytes, bytes]) -> None:
        rid = gen.request_id
        backoff = Backoff(initial_s=0.2, max_s=self.settings.process.retry_backoff_max_s)
        try:
            while True:
                try:
                    with layer_span(self.tracer, "infer", gen.task["envelope"]) as span:
                        await gen.run()
                        span.set_attributes({**gen.span_attributes(),
                                             "conveyor.worker_id": self.worker_id})
                    break
                except _TRANSIENT as exc:
                    # Kafka did not take the chunks (or Redis/Kafka could not be read):
                    # the task is not done; run it again from the log once they answer
                    deadline = gen.task["envelope"]["deadline_ms"]
                    if gen.handed_off or (deadline and time.time() * 1000 > deadline + 60_000):
                        log.error("worker %s: giving %s up after %r", self.worker_id, rid, exc)
                        break
                    log.warning("worker %s: %s interrupted by %r; resuming it from the log",
                                self.worker_id, rid, exc)
                    await backoff.wait()
            # kept for the record even when the task went to another worker (a
            # redrive of it then finds the request done: the progress claim)
            if gen.engine_failure is not None:
                await self._dead_letter(gen, record, gen.engine_failure)
        except Exception:
            # Not a request failure the engine reported: keep the task for the record.
            log.exception("worker %s: generation %s failed (trace %s)", self.worker_id,
                          rid, trace_id_of(gen.task["envelope"]))
            await self._dead_letter(gen, record, traceback.format_exc())
        finally:
            running = self.running.pop(rid, None)
            self._slot_freed.set()
            if running is not None and not gen.handed_off:
                # not handed off: done; a handed-off task's offset stays for its new owner
                for tp, offset, epoch in running.bookings:
                    self._done(tp, offset, epoch)

    async def _dead_letter(self, gen: TaskRun, record: ConsumerRecord[bytes, bytes],
                           error: str) -> None:
        self.dead_lettered()
        sender = gen.records.sender
        with contextlib.suppress(Exception):
            await sender.deliver(sender.letter_output(
                "infer", record.topic, record.partition, record.offset, record.key,
                record.value, error))

    def _done(self, tp: TopicPartition, offset: int, epoch: int) -> None:
        self.offsets.finish(tp, offset, epoch)
        self._slot_freed.set()
        self._commit_due.set()

    async def _keep_leases(self, store: ProgressTracker) -> None:
        """Renew the leases of the running tasks, so no other worker takes them over;
        notice a Redis that restarted."""
        await store.keep([rid for rid, r in self.running.items() if r.run.leased],
                         self.worker_id)
        await store.check_redis()

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
            except (*COMMIT_REFUSED, KafkaError) as exc:
                log.warning("worker %s: commit skipped: %r", self.worker_id, exc)
                self._commit_due.set()  # try again with the next round

    def _runs(self) -> list[TaskRun]:
        return [r.run for r in self.running.values()]

    def _on_cancel(self, request_id: str) -> None:
        running = self.running.get(request_id)
        if running is not None:
            running.run.cancelled = True

    def assignor_state(self) -> tuple[set[TopicPartition], set[TopicPartition]]:
        """For the group's assignor: the partitions owned, and those running answers."""
        busy = {tp for r in self.running.values() for tp, _, _ in r.bookings}
        return self.partitions | self.owned_before, busy

    def load(self) -> tuple[int, int, int]:
        """Capacity, generations running, and tasks in this worker's partitions not
        taken yet (conveyor.metrics.WorkerMetrics reads it at each scrape)."""
        taken = {tp: n for tp, n in list(self._taken.items()) if tp in self.partitions}
        queued = sum(lag for _, lag in partition_lag(self._consumer, taken))
        return self.engine.capacity, len(self.running), queued

    def _snapshot(self) -> Snapshot:
        interactive = sum(1 for r in self.running.values()
                          if r.run.task["envelope"]["priority"] == PRIORITY_INTERACTIVE)
        return Snapshot([tp.partition for tp in self.partitions], len(self.running),
                        interactive, self.interactive_ms)

    async def _beat(self, heartbeat: Heartbeat) -> None:
        """One heartbeat, then wait for the next (or an early one)."""
        await asyncio.wait_for(heartbeat.beat(), _BEAT_TIMEOUT_S)
        self._beat_now.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._beat_now.wait(), self.settings.infer.heartbeat_interval_s)

    async def _drain(self, heartbeat: Heartbeat) -> None:
        """Stop taking tasks, let the running ones end (bounded), commit them."""
        heartbeat.state = "draining"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(heartbeat.beat(), _BEAT_TIMEOUT_S)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=_DRAIN_TIMEOUT_S)
        await self.commit()

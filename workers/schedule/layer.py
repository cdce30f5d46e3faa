"""Schedule: pick the least loaded live worker of the pool, address its partition.

When no worker of the pool is live, the task is parked, not waited for: the
layer goes on scheduling other pools' tasks, a background task places the
parked ones (in arrival order) as soon as a worker appears, and a task still
parked ``no_worker_timeout_s`` after it entered the pipeline fails with 503
``no_worker_available``. A parked task's offset is not committed, so a
scheduler that dies with tasks parked leaves them to its successor. A request
whose deadline has passed fails with 504 instead of being sent to a worker.

A cancelled request's parked task is dropped (``cancel``, called by the
runtime for every cancel on ``conveyor.control``), so no task for it reaches
infer after the cancel. When the worker table cannot see the heartbeats
(Kafka unreachable, or contact regained too recently to have heard every
worker), a task out of time fails with 503 ``pipeline_unavailable``, not
``no_worker_available``: the workers may well be alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from conveyor.errors import (
    DeadlineExceeded,
    NoWorkerAvailable,
    PermanentBrokerError,
    PipelineUnavailable,
    RequestError,
    SchemaError,
)
from conveyor.settings import Settings
from schemas.codec import EventType
from schemas.records import Task
from topics.catalog import infer_topic
from topics.envelope import now_ms, stamp
from workers.outputs import Output, Sender, error_info, failure_reply
from workers.schedule.table import WorkerTable

__all__ = ["ScheduleLayer", "Parked"]

log = logging.getLogger(__name__)

_RECHECK_S = 0.25


@dataclass
class Parked:
    task: Task
    tp: TopicPartition | None
    offset: int
    give_up_ms: int


class ScheduleLayer:
    name = "schedule"
    source_type: EventType = "Task"

    def __init__(self, settings: Settings, table: WorkerTable | None = None,
                 clock: Callable[[], int] = now_ms) -> None:
        self.settings = settings
        self.table = table or WorkerTable(settings)
        self.source_topic = settings.topic("routed")
        self.parked: list[Parked] = []
        self.clock = clock
        self._sender: Sender | None = None
        self._background: list[asyncio.Task[None]] = []

    async def start(self, sender: Sender) -> None:
        """Read the heartbeats seen so far before scheduling (a bounded wait:
        while Kafka cannot be reached, tasks park and the table says so)."""
        self._sender = sender
        ready = asyncio.Event()
        follower = asyncio.create_task(self.table.follow(ready), name="worker-table")
        self._background = [follower]
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, follower], timeout=self.settings.no_worker_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if follower.done():
            follower.result()  # surface the failure
        self._background.append(asyncio.create_task(self._place_parked_loop(), name="parked"))

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _check_background(self) -> None:
        for task in self._background:
            if task.done():
                task.result()  # re-raise on the caller, never lost

    async def handle(self, event: Task, record: Any) -> list[Output]:
        self._check_background()
        envelope = stamp(event["envelope"], self.name)
        pool = event["route"]["pool"]
        entered_ms = envelope["stamps"].get("gateway", envelope["stamps"][self.name]) // 1000
        give_up_ms = entered_ms + int(self.settings.no_worker_timeout_s * 1000)
        if envelope["deadline_ms"]:
            give_up_ms = min(give_up_ms, envelope["deadline_ms"])
        waiting = any(p.task["route"]["pool"] == pool for p in self.parked)
        if not waiting:  # keep arrival order: behind tasks of the pool already parked
            placed = self.place(event)
            if placed is not None:
                return [placed]
        tp = TopicPartition(record.topic, record.partition) if record is not None else None
        self.parked.append(Parked(event, tp, record.offset if record is not None else -1,
                                  give_up_ms))
        return []

    def place(self, task: Task) -> Output | None:
        """The output sending ``task`` to a live worker, or None when none is live."""
        envelope = task["envelope"]
        if envelope["deadline_ms"] and self.clock() >= envelope["deadline_ms"]:
            raise DeadlineExceeded("The request's deadline passed before a worker took it.")
        choice = self.table.choose(task["route"]["pool"])
        if choice is None:
            return None
        worker, partition = choice
        task["route"]["worker_id"] = worker.beat["worker_id"]
        task["route"]["partition"] = partition
        return Output(infer_topic(self.settings, task["route"]["pool"]), "Task", task,
                      key=envelope["request_id"], partition=partition)

    def cancel(self, request_id: str) -> None:
        """Drop the parked task of a cancelled request (its offset is released)."""
        self.parked = [p for p in self.parked if p.task["envelope"]["request_id"] != request_id]

    def _out_of_time(self, parked: Parked) -> RequestError:
        pool = parked.task["route"]["pool"]
        if self.table.settling():
            return PipelineUnavailable(
                "The pipeline is unavailable: the scheduler cannot reach Kafka to see the "
                f"workers of pool `{pool}`. Try again later.")
        return NoWorkerAvailable(
            f"No worker of pool `{pool}` is available for model "
            f"`{parked.task['route']['model']}`. Try again later.")

    async def place_parked(self) -> None:
        """Send every parked task that now has a worker; fail those out of time."""
        sender = self._sender
        assert sender is not None
        blocked: set[str] = set()
        for parked in list(self.parked):
            if not any(p is parked for p in self.parked):
                continue  # cancelled while an earlier one was being sent
            pool = parked.task["route"]["pool"]
            outputs: list[Output] = []
            try:
                out = None if pool in blocked else self.place(parked.task)
                if out is None and self.clock() >= parked.give_up_ms:
                    raise self._out_of_time(parked)
            except RequestError as exc:
                reply = sender.error_output(parked.task["envelope"], error_info(exc))
                outputs = [reply] if reply is not None else []
            else:
                if out is None:
                    blocked.add(pool)  # later tasks of the pool stay behind this one
                    continue
                outputs = [out]
            await self._deliver(sender, parked, outputs)
            # handle() may have parked more, or a cancel dropped some, meanwhile
            self.parked = [p for p in self.parked if p is not parked]

    async def _deliver(self, sender: Sender, parked: Parked, outputs: list[Output]) -> None:
        """Produce a parked task's outcome; what can never be produced fails the request."""
        try:
            await sender.produce(outputs)
        except (PermanentBrokerError, SchemaError) as exc:
            envelope = parked.task["envelope"]
            log.error("request %s: cannot send its task: %s", envelope["request_id"], exc)
            reply = sender.error_output(envelope, error_info(failure_reply(exc, self.name)))
            if reply is not None:
                with contextlib.suppress(PermanentBrokerError, SchemaError):
                    await sender.produce([reply])

    async def _place_parked_loop(self) -> None:
        while True:
            if self.parked:
                await self.place_parked()
            self.table.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.table.changed.wait(), _RECHECK_S)

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """Never commit past a task still parked on ``tp``."""
        return min([next_offset, *(p.offset for p in self.parked if p.tp == tp)])

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """Tasks parked from those partitions are the new owner's to schedule."""
        gone = set(partitions)
        self.parked = [p for p in self.parked if p.tp not in gone]

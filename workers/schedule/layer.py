"""Schedule: pick the least loaded live worker of the pool, address its partition.

When no worker of the pool is live, the request waits until one appears or
until ``no_worker_timeout_s`` after it entered the pipeline, then fails with
503 ``no_worker_available``. A request whose deadline has passed fails with
504 instead of being sent to a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka import TopicPartition

from conveyor.errors import DeadlineExceeded, NoWorkerAvailable
from conveyor.settings import Settings
from schemas.codec import EventType
from schemas.records import Task
from topics.catalog import infer_topic
from topics.envelope import now_ms, stamp
from workers.outputs import Output
from workers.schedule.table import WorkerTable

__all__ = ["ScheduleLayer"]

log = logging.getLogger(__name__)


class ScheduleLayer:
    name = "schedule"
    source_type: EventType = "Task"

    def __init__(self, settings: Settings, table: WorkerTable | None = None) -> None:
        self.settings = settings
        self.table = table or WorkerTable(settings)
        self.source_topic = settings.topic("routed")
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()
        self._follower = asyncio.create_task(self.table.follow(ready), name="worker-table")
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, self._follower], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._follower.done():
            self._follower.result()  # surface the failure

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    def _check_follower(self) -> None:
        if self._follower is not None and self._follower.done():
            self._follower.result()  # re-raise on the caller, never lost

    async def handle(self, event: Task, record: Any) -> list[Output]:
        envelope = stamp(event["envelope"], self.name)
        pool = event["route"]["pool"]
        entered_ms = envelope["stamps"].get("gateway", envelope["stamps"][self.name]) // 1000
        give_up_ms = entered_ms + int(self.settings.no_worker_timeout_s * 1000)
        if envelope["deadline_ms"]:
            give_up_ms = min(give_up_ms, envelope["deadline_ms"])
        while True:
            self._check_follower()
            if envelope["deadline_ms"] and now_ms() >= envelope["deadline_ms"]:
                raise DeadlineExceeded("The request's deadline passed before a worker took it.")
            choice = self.table.choose(pool)
            if choice is not None:
                break
            wait_ms = give_up_ms - now_ms()
            if wait_ms <= 0:
                raise NoWorkerAvailable(
                    f"No worker of pool `{pool}` is available for model "
                    f"`{event['route']['model']}`. Try again later."
                )
            self.table.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.table.changed.wait(), min(wait_ms / 1000, 0.25))
        worker, partition = choice
        event["route"]["worker_id"] = worker.beat["worker_id"]
        event["route"]["partition"] = partition
        return [
            Output(infer_topic(self.settings, pool), "Task", event,
                   key=envelope["request_id"], partition=partition)
        ]

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        return next_offset

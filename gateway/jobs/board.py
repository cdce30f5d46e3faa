"""Every job's latest state, followed in memory from the compacted
``conveyor.job-status`` topic (the record: no Redis for jobs), keeping only
newer versions. A job not seen yet is waited for briefly before it is missing;
another tenant's job is missing, never forbidden."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Literal

from conveyor.errors import RequestError
from conveyor.settings import Settings
from gateway.auth.types import Identity
from gateway.errors import NotFound
from gateway.health import TaskHealth
from gateway.publisher import Publisher
from schemas.codec import Codec
from schemas.records import Generation, JobCommand, JobStatus
from topics.catalog import JOB_STATUS, JOBS
from topics.envelope import now_ms
from topics.follow import apply_all, follow

__all__ = ["JobBoard", "JobDesk"]

log = logging.getLogger(__name__)

_MISSING_WAIT_S = 1.5


class JobBoard:
    def __init__(self, settings: Settings, codec: Codec) -> None:
        self.settings = settings
        self.codec = codec
        self.statuses: dict[str, JobStatus] = {}
        self.changed = asyncio.Event()

    def put(self, status: JobStatus) -> bool:
        """Keep ``status`` if it is newer than what is held; True when kept."""
        held = self.statuses.get(status["job_id"])
        if held is not None and held["version"] >= status["version"]:
            return False
        self.statuses[status["job_id"]] = status
        self.changed.set()
        self.changed = asyncio.Event()
        return True

    async def run(self, part: TaskHealth | None = None) -> None:
        """Follow the topic for ever (the follower survives Kafka outages)."""
        def caught_up() -> None:
            if part is not None:
                part.set("ok")

        await apply_all(follow(self.settings, JOB_STATUS, 0, "beginning"), self.codec,
                        self.put, caught_up)

    async def get(self, tenant: str, job_id: str, kind: Literal["batch", "response"]
                  ) -> dict[str, Any] | None:
        """The job's object, or None when it does not exist for this tenant."""
        deadline = time.monotonic() + _MISSING_WAIT_S
        while True:
            status = self.statuses.get(job_id)
            if status is not None:
                if status["tenant"] != tenant or status["kind"] != kind:
                    return None
                obj: dict[str, Any] = json.loads(status["object"])
                return obj
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return None

    def listing(self, tenant: str, kind: Literal["batch", "response"]) -> list[dict[str, Any]]:
        """The tenant's jobs of a kind, newest first."""
        objs = [json.loads(s["object"]) for s in self.statuses.values()
                if s["tenant"] == tenant and s["kind"] == kind]
        return sorted(objs, key=lambda o: (o.get("created_at") or 0, o.get("id", "")),
                      reverse=True)


class JobDesk:
    """What the Batch API and background responses share: a job's first state and
    its commands written through the gateway's publisher (503 when Kafka does
    not take them in time), its state read from the board."""

    kind: Literal["batch", "response"]
    missing: str  # the 404's message, ``{}`` the job's id

    def __init__(self, settings: Settings, publisher: Publisher, board: JobBoard) -> None:
        self.settings = settings
        self.publisher = publisher
        self.board = board

    async def open(self, identity: Identity, job_id: str, obj: dict[str, Any],
                   command: JobCommand) -> None:
        # version 0: whatever the collector publishes later wins, whatever the clocks
        status = JobStatus(job_id=job_id, kind=self.kind, tenant=identity.tenant, version=0,
                           ts_ms=now_ms(), object=json.dumps(obj))
        await self.publisher.publish(JOB_STATUS, status, job_id, what=f"the {self.kind}")
        await self.publisher.publish(JOBS, command, job_id, what=f"the {self.kind}")
        self.board.put(status)

    async def retrieve(self, identity: Identity, job_id: str) -> dict[str, Any]:
        obj = await self.board.get(identity.tenant, job_id, self.kind)
        if obj is None:
            raise NotFound(self.missing.format(job_id))
        return obj

    def command(self, identity: Identity, job_id: str, action: Literal["create", "cancel"],
                endpoint: str, *, input_file_id: str = "", completion_window: str = "",
                metadata: dict[str, str] | None = None, generation: Generation | None = None,
                models: list[str] | None = None, body: str = "") -> JobCommand:
        return JobCommand(job_id=job_id, kind=self.kind, action=action, tenant=identity.tenant,
                          key_id=identity.key_id, ts_ms=now_ms(), input_file_id=input_file_id,
                          endpoint=endpoint, completion_window=completion_window,
                          metadata=metadata or {}, generation=generation, models=models or [],
                          body=body)

    def not_cancellable(self, status: str) -> RequestError:
        return RequestError(f"Cannot cancel a {self.kind} that is {status}.", status=409,
                            type="invalid_request_error", code=None)

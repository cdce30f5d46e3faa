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

from conveyor.settings import Settings
from gateway.health import TaskHealth
from schemas.codec import Codec
from schemas.records import JobStatus
from topics.catalog import JOB_STATUS
from topics.follow import apply_all, follow

__all__ = ["JobBoard"]

log = logging.getLogger(__name__)

_MISSING_WAIT_S = 1.5


class JobBoard:
    def __init__(self, settings: Settings, codec: Codec) -> None:
        self.settings = settings
        self.codec = codec
        self.statuses: dict[str, JobStatus] = {}
        self.changed = asyncio.Event()
        self.caught_up = asyncio.Event()

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
            self.caught_up.set()
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

    async def wait_for(self, tenant: str, job_id: str, kind: Literal["batch", "response"],
                       statuses: tuple[str, ...], timeout_s: float) -> dict[str, Any] | None:
        """The job's object once its status is one of ``statuses`` (or at the timeout)."""
        deadline = time.monotonic() + timeout_s
        obj = await self.get(tenant, job_id, kind)
        while obj is not None and obj.get("status") not in statuses:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with_change = self.changed
            try:
                await asyncio.wait_for(with_change.wait(), left)
            except TimeoutError:
                break
            obj = await self.get(tenant, job_id, kind)
        return obj

    def listing(self, tenant: str, kind: Literal["batch", "response"]) -> list[dict[str, Any]]:
        """The tenant's jobs of a kind, newest first."""
        objs = [json.loads(s["object"]) for s in self.statuses.values()
                if s["tenant"] == tenant and s["kind"] == kind]
        return sorted(objs, key=lambda o: (o.get("created_at") or 0, o.get("id", "")),
                      reverse=True)

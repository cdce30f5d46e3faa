"""The state of the gateway's background tasks, as ``/healthz`` reports it. Each
task owns a :class:`TaskHealth`: ``starting``, ``ok``, ``degraded`` (an outage
it retries) or ``failed`` (what retrying does not cure); one that stops says
so. ``/healthz`` answers 200 only while every task is ``ok``, so a load
balancer takes a gateway unsure of its replies out of rotation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["TaskHealth", "HealthState", "Health"]

HealthState = Literal["starting", "ok", "degraded", "failed"]


@dataclass
class TaskHealth:
    """What one background task is doing, and since when."""

    name: str
    state: HealthState = "starting"
    detail: str = ""
    since: float = field(default_factory=time.time)

    def set(self, state: HealthState, detail: str = "") -> bool:
        """Record a state; True when it changed (worth a log line)."""
        changed = state != self.state
        if changed:
            self.since = time.time()
        self.state, self.detail = state, detail
        return changed

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail, "since": round(self.since, 3)}


@dataclass
class Health:
    """Every background task's health, and the asyncio tasks that run them."""

    gateway_id: str
    parts: list[TaskHealth] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # what the report shows besides the tasks, read as it is made (the fleet's
    # open breakers): facts about the fleet, not the gateway's own health
    extras: dict[str, Callable[[], Any]] = field(default_factory=dict)

    def part(self, name: str) -> TaskHealth:
        part = TaskHealth(name)
        self.parts.append(part)
        return part

    def report(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, the body of ``/healthz``)."""
        for task in self.tasks:
            if task.done():  # a task must not end; if one did, the gateway is broken
                exc = None if task.cancelled() else task.exception()
                part = next((p for p in self.parts if p.name == task.get_name()), None)
                if part is not None and part.state != "failed":
                    part.set("failed", f"stopped: {exc!r}")
        states = [p.state for p in self.parts]
        if not states or "starting" in states:
            status = "starting"
        elif "failed" in states:
            status = "failed"
        elif "degraded" in states:
            status = "degraded"
        else:
            status = "ok"
        body: dict[str, Any] = {"status": status, "gateway": self.gateway_id,
                                "tasks": {p.name: p.as_dict() for p in self.parts},
                                **{name: read() for name, read in self.extras.items()}}
        return status == "ok", body

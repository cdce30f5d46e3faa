"""Fallbacks: a task whose model's pool cannot take it goes to the first of its
fallbacks whose pool can (one hop, only when it is placed, before any
token). Its route then names the model that answers, and ``fallback_from``
the one asked for (docs/decisions/0010-breakers-and-fallbacks.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from schemas.records import Task

__all__ = ["fall_back", "others_can_take"]

log = logging.getLogger(__name__)

W = TypeVar("W")


def fall_back(task: Task, open_workers: Callable[[str, str], list[W]]) -> list[W]:
    """The workers of the first fallback whose pool has some open to work
    (``open_workers(pool, model)``), the task rerouted there; none: unchanged."""
    route = task["route"]
    for fallback in route.get("fallbacks", []):
        workers = open_workers(fallback["pool"], fallback["model"])
        if workers:
            log.info("request %s: model %s cannot be served now; %s answers it",
                     task["envelope"]["request_id"], route["model"], fallback["model"])
            route["fallback_from"] = route["model"]
            route["model"], route["pool"] = fallback["model"], fallback["pool"]
            route["fallbacks"] = []
            return workers
    return []


def others_can_take(task: Task, open_workers: Callable[[str, str], list[W]],
                    worker_id: Callable[[W], str]) -> bool:
    """Whether a task an engine failed before its first token has somewhere
    else to go: an open worker of its pool that has not failed it, or a
    fallback with an open worker. Said in the log either way."""
    route = task["route"]
    failed = list(route.get("failed_workers") or ())
    others = [w for w in open_workers(route["pool"], route["model"])
              if worker_id(w) not in failed]
    fallbacks = [f for f in route.get("fallbacks", []) if open_workers(f["pool"], f["model"])]
    failure = route.get("failure")
    log.info("request %s: the engine of worker %s failed before the first token (%s); %s",
             task["envelope"]["request_id"], failed[-1] if failed else "?",
             failure["message"] if failure else "",
             "another worker takes it" if others or fallbacks else "no other can")
    return bool(others or fallbacks)

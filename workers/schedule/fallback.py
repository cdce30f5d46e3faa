"""Fallbacks: a task whose model's pool cannot take it (no live worker, every
breaker open) goes to the first of its fallbacks whose pool can (route lists
them, those whose context fits the prompt). Its route then names the model
that answers, and ``fallback_from`` the one asked for: the answer's ``model``
names the first, and the gateway says a fallback happened. One hop: a
fallback's own fallbacks are not followed. It happens only when the task is
placed, before any token, never after."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from schemas.records import Task

__all__ = ["fall_back"]

log = logging.getLogger(__name__)

W = TypeVar("W")


def fall_back(task: Task, open_workers: Callable[[str], list[W]]) -> list[W]:
    """The workers of the first fallback whose pool has some open to work
    (``open_workers(pool)``), the task rerouted there; none: unchanged."""
    route = task["route"]
    for fallback in route.get("fallbacks", []):
        workers = open_workers(fallback["pool"])
        if workers:
            log.info("request %s: model %s cannot be served now; %s answers it",
                     task["envelope"]["request_id"], route["model"], fallback["model"])
            route["fallback_from"] = route["model"]
            route["model"], route["pool"] = fallback["model"], fallback["pool"]
            route["fallbacks"] = []
            return workers
    return []

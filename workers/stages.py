"""The pipeline's layers, declared once: each :class:`Stage` names a layer, the
topic it consumes, the topics it writes, those of its outputs ``conveyor
replay`` compares, and a factory that imports its layer when called (reading
the table loads no layer). Infer is not a stage: its workers are a consumer
group per pool (workers/infer/engines/table.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConveyorError
from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.codec import EventType
from topics.catalog import (
    CONTROL,
    DLQ,
    INFER,
    JOB_STATUS,
    JOBS,
    PREPARED,
    REPLIES,
    REQUESTS,
    RESULTS,
    ROUTED,
    TOKENS,
    USAGE,
    Topic,
)
from workers.layer import Layer

__all__ = ["STAGES", "Stage", "UnknownStage", "stage", "stage_names"]


class UnknownStage(ConveyorError):
    """A layer name that is not in the table."""


@dataclass(frozen=True)
class Stage:
    name: str
    source: Topic[Any]  # the topic it consumes
    outputs: tuple[Topic[Any], ...]  # the topics it writes to
    make: Callable[[Settings, Registry], Layer]
    # the outputs ``conveyor replay`` compares; () when it is not replayed
    # (schedule and infer need live workers, the jobs layers write files)
    replayed: tuple[Topic[Any], ...] = ()

    @property
    def source_type(self) -> EventType:
        """The event it handles (a layer's source carries one type)."""
        return self.source.handled[0]

    @property
    def replayed_types(self) -> tuple[EventType, ...]:
        return tuple(e for topic in self.replayed for e in topic.handled)

    @property
    def replayable(self) -> bool:
        return bool(self.replayed)


def _preprocess(settings: Settings, registry: Registry) -> Layer:
    from workers.preprocess import PreprocessLayer

    return PreprocessLayer(settings, registry)


def _route(settings: Settings, registry: Registry) -> Layer:
    from workers.route import RouteLayer

    return RouteLayer(settings, registry)


def _schedule(settings: Settings, registry: Registry) -> Layer:
    from workers.schedule import ScheduleLayer

    return ScheduleLayer(settings)


def _postprocess(settings: Settings, registry: Registry) -> Layer:
    from workers.postprocess import PostprocessLayer

    return PostprocessLayer(settings)


def _jobs(settings: Settings, registry: Registry) -> Layer:
    from conveyor.files.local import LocalFileStore
    from workers.jobs.commands import JobsLayer

    return JobsLayer(settings, LocalFileStore(settings.jobs), registry)


def _results(settings: Settings, registry: Registry) -> Layer:
    from conveyor.files.local import LocalFileStore
    from workers.jobs.collector import ResultsLayer

    return ResultsLayer(settings, LocalFileStore(settings.jobs))


STAGES: tuple[Stage, ...] = (
    Stage("preprocess", REQUESTS, (PREPARED, REPLIES, RESULTS, DLQ), _preprocess,
          replayed=(PREPARED,)),
    Stage("route", PREPARED, (ROUTED, REPLIES, RESULTS, DLQ), _route, replayed=(ROUTED,)),
    Stage("schedule", ROUTED, (INFER, REPLIES, RESULTS, DLQ), _schedule),
    Stage("postprocess", TOKENS, (REPLIES, RESULTS, USAGE, CONTROL, DLQ), _postprocess,
          replayed=(REPLIES, RESULTS)),
    Stage("jobs", JOBS, (REQUESTS, RESULTS, CONTROL, JOB_STATUS, DLQ), _jobs),
    Stage("results", RESULTS, (JOB_STATUS, DLQ), _results),
)


def stage_names() -> tuple[str, ...]:
    return tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    """The stage called ``name``; :class:`UnknownStage` names the choices."""
    for s in STAGES:
        if s.name == name:
            return s
    raise UnknownStage(f"unknown layer {name!r}; choose from {', '.join(stage_names())}")

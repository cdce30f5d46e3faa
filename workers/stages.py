"""The pipeline's layers, declared once.

Each :class:`Stage` names a layer, the topic it consumes and the event type
on it, the topics it writes, what ``conveyor replay`` compares of its
outputs, and a factory typed to :class:`~workers.layer.Layer`. ``conveyor
layer`` runs stages by name, ``conveyor replay`` builds the replayable ones
afresh under a scratch prefix, and the tests check every stage's factory
against its declaration (source topic and event type). Adding a layer is
its module plus one line in :data:`STAGES`.

The factories import their layer when called, so reading the table (as the
command line does for every command) loads no layer's dependencies.
Infer is not a stage: its workers are a consumer group of their own per
pool, with an engine (workers/infer/engines/table.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.errors import ConveyorError
from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.codec import EventType
from workers.layer import Layer

__all__ = ["STAGES", "Stage", "UnknownStage", "stage", "stage_names"]


class UnknownStage(ConveyorError):
    """A layer name that is not in the table."""


@dataclass(frozen=True)
class Stage:
    name: str
    source: str  # the topic it consumes, without the prefix (settings.topic(source))
    source_type: EventType
    outputs: tuple[str, ...]  # the topics it writes to, without the prefix
    make: Callable[[Settings, Registry], Layer]
    # what ``conveyor replay`` compares of its outputs; () when it is not replayed
    # (schedule and infer need live workers, the jobs layers write files)
    replayed: tuple[EventType, ...] = ()

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

    return ScheduleLayer(settings, prefetch=settings.batch_prefetch,
                         linger_s=settings.interactive_linger_s)


def _postprocess(settings: Settings, registry: Registry) -> Layer:
    from workers.postprocess import PostprocessLayer

    return PostprocessLayer(settings)


def _jobs(settings: Settings, registry: Registry) -> Layer:
    from conveyor.files.local import LocalFileStore
    from workers.jobs.commands import JobsLayer

    return JobsLayer(settings, LocalFileStore(settings), registry)


def _results(settings: Settings, registry: Registry) -> Layer:
    from conveyor.files.local import LocalFileStore
    from workers.jobs.collector import ResultsLayer

    return ResultsLayer(settings, LocalFileStore(settings))


STAGES: tuple[Stage, ...] = (
    Stage("preprocess", "requests", "Request", ("prepared", "replies", "results", "dlq"),
          _preprocess, replayed=("Prepared",)),
    Stage("route", "prepared", "Prepared", ("routed", "replies", "results", "dlq"),
          _route, replayed=("Task",)),
    Stage("schedule", "routed", "Task", ("infer.<pool>", "replies", "results", "dlq"),
          _schedule),
    Stage("postprocess", "tokens", "TokenChunk",
          ("replies", "results", "usage", "control", "dlq"), _postprocess,
          replayed=("Reply", "JobResult")),
    Stage("jobs", "jobs", "JobCommand",
          ("requests", "results", "control", "job-status", "dlq"), _jobs),
    Stage("results", "results", "JobResult", ("job-status", "dlq"), _results),
)


def stage_names() -> tuple[str, ...]:
    return tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    """The stage called ``name``; :class:`UnknownStage` names the choices."""
    for s in STAGES:
        if s.name == name:
            return s
    raise UnknownStage(f"unknown layer {name!r}; choose from {', '.join(stage_names())}")

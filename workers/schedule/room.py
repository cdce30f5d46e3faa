"""Admission of interactive tasks: a free slot and, where the worker reports
its KV cache, free KV for the prompt plus ``max_tokens``; the refusals of a
task that waits too long or can never fit
(docs/decisions/0005-schedule-holds-the-queue.md)."""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka import TopicPartition

from conveyor.errors import (
    ContextLengthExceeded,
    DeadlineExceeded,
    NoWorkerAvailable,
    Overloaded,
    PipelineUnavailable,
    RequestError,
)
from conveyor.settings import Settings
from schemas.records import Envelope, Task
from topics.envelope import now_us
from workers.schedule.table import WorkerView

__all__ = ["Parked", "kv_need", "free_kv", "has_room", "interactive_busy", "never_fits",
           "overloaded", "out_of_time", "check_deadline", "expiry_ms"]


@dataclass
class Parked:
    """An interactive task waiting in schedule for a worker with room."""
    task: Task
    tp: TopicPartition | None
    offset: int
    entered_ms: int  # when the request entered the pipeline

    def give_up_ms(self, settings: Settings, served: bool) -> int:
        """When it is refused: ``schedule_timeout_s`` after it entered while its
        pool has open workers (``served``, with no room), ``no_worker_timeout_s``
        while it has none; its deadline, if sooner."""
        wait_s = settings.schedule.timeout_s if served else settings.schedule.no_worker_timeout_s
        at = self.entered_ms + int(wait_s * 1000)
        deadline = self.task["envelope"]["deadline_ms"]
        return min(at, deadline) if deadline else at


def kv_need(task: Task) -> int:
    """The KV tokens ``task`` may take: its prompt and every token it may generate."""
    prompt = task["prompt"]
    return prompt["tokens"] + prompt["max_tokens"]


def free_kv(view: WorkerView) -> int | None:
    """KV tokens free on the worker now, as far as this scheduler knows; None
    when the worker reports no KV cache."""
    kv = view.beat.get("kv")
    if not kv or not kv["total_blocks"]:
        return None
    return kv["free_blocks"] * kv["block_tokens"] - view.kv_since_beat


def has_room(view: WorkerView, busy: int, need: int) -> bool:
    """A free slot, and free KV for ``need`` tokens where the worker reports it."""
    if busy >= view.beat["capacity"]:
        return False
    free = free_kv(view)
    return free is None or need <= free


def interactive_busy(view: WorkerView, busy: int, low_sent: int) -> int:
    """A worker's tasks (``busy``) less its batch and background ones (by its beat,
    or the ``low_sent`` this scheduler sent it): those keep to their share
    (held.py, BatchAdmission) and never keep an interactive task from a slot."""
    low = max(view.beat["running"] - view.beat["interactive_running"], low_sent)
    return max(0, busy - low)


def never_fits(task: Task, live: list[WorkerView]) -> ContextLengthExceeded | None:
    """The error for a task more than every live worker's whole KV cache could
    hold (only when each of them reports one); None when some worker could."""
    need = kv_need(task)
    totals = []
    for view in live:
        kv = view.beat.get("kv")
        if not kv or not kv["total_blocks"]:
            return None
        totals.append(kv["total_blocks"] * kv["block_tokens"])
    if not totals or need <= max(totals):
        return None
    prompt, route = task["prompt"], task["route"]
    return ContextLengthExceeded(
        f"This request needs {need} tokens of KV cache ({prompt['tokens']} in the prompt "
        f"and up to {prompt['max_tokens']} to generate, max_tokens), more than any "
        f"worker serving model `{route['model']}` holds ({max(totals)} tokens). "
        f"Lower max_tokens or shorten the prompt.", param="max_tokens")


def overloaded(task: Task, waited_s: float | None) -> Overloaded:
    """A task refused for want of room: waited out (``waited_s``) or turned away
    at a full queue (None)."""
    route = task["route"]
    why = (f"no worker had room for it within {waited_s:g} s" if waited_s is not None
           else "too many requests are waiting for a worker already")
    return Overloaded(f"The workers serving model `{route['model']}` are overloaded: "
                      f"{why}. Please retry after a short wait.")


def out_of_time(parked: Parked, served: bool, settling: bool,
                settings: Settings) -> RequestError:
    """Why a parked task is refused: overloaded workers (``served``), a scheduler
    that cannot see the workers (``settling``: Kafka unreachable, or reached
    again too recently), or no live worker at all."""
    pool = parked.task["route"]["pool"]
    if served:
        return overloaded(parked.task, settings.schedule.timeout_s)
    if settling:
        return PipelineUnavailable(
            "The pipeline is unavailable: the scheduler cannot reach Kafka to see the "
            f"workers of pool `{pool}`. Try again later.")
    return NoWorkerAvailable(
        f"No worker of pool `{pool}` is available for model "
        f"`{parked.task['route']['model']}`. Try again later.")


def check_deadline(envelope: Envelope, now_ms: int) -> None:
    if envelope["deadline_ms"] and now_ms >= envelope["deadline_ms"]:
        raise DeadlineExceeded("The request's deadline passed before a worker took it.")


def expiry_ms(envelope: Envelope, settings: Settings) -> int:
    """Until when a request may wait: its deadline, or the request timeout."""
    if envelope["deadline_ms"]:
        return envelope["deadline_ms"]
    entered_ms = envelope["stamps"].get("gateway", now_us()) // 1000
    return entered_ms + int(settings.gateway.request_timeout_s * 1000)

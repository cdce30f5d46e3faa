"""Schedule's gauges (``conveyor.schedule.*``), read at each scrape of the
layers process's metrics: what this scheduler member knows (several members
each report their own waiting, held and sent tasks, and the breakers they read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from workers.schedule.breakers import Breakers
from workers.schedule.held import HeldQueue
from workers.schedule.outstanding import Outstanding
from workers.schedule.room import Parked
from workers.schedule.table import WorkerTable

__all__ = ["instrument"]

_BREAKER_LEVEL = {"closed": 0, "half_open": 1, "open": 2}

Observe = Callable[[CallbackOptions], Iterable[Observation]]


class Observed(Protocol):
    """What the gauges read of the schedule layer (no import of the layer,
    which imports this module)."""

    breakers: Breakers
    parked: list[Parked]
    held: HeldQueue
    outstanding: Outstanding
    table: WorkerTable


def instrument(layer: Observed, meter: Meter) -> None:
    """Make schedule's gauges on ``meter``, observing ``layer``."""

    def breakers(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(_BREAKER_LEVEL.get(s["state"], 0),
                            {"conveyor.worker": s["worker_id"], "conveyor.pool": s["pool"]})
                for s in list(layer.breakers.states.values())]

    def waiting(options: CallbackOptions) -> Iterable[Observation]:
        pools = Counter(p.task["route"]["pool"] for p in list(layer.parked))
        for pool in layer.table.pools():
            pools.setdefault(pool, 0)
        return [Observation(n, {"conveyor.pool": pool}) for pool, n in pools.items()]

    def held(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(layer.held.count(pool), {"conveyor.pool": pool})
                for pool in {*layer.held.pools(), *layer.table.pools()}]

    def sent(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(layer.outstanding.at(wid), {"conveyor.worker": wid})
                for wid in list(layer.table.workers)]

    gauges: tuple[tuple[str, Observe, str, str], ...] = (
        ("breaker_state", breakers, "1",
         "Each worker's circuit breaker: 0 closed, 1 half-open (a probe out), 2 open."),
        ("waiting", waiting, "{request}",
         "Interactive tasks waiting in schedule for a worker with room."),
        ("held", held, "{request}", "Batch and background tasks held back in schedule."),
        ("sent", sent, "{request}",
         "Tasks this scheduler sent to a worker whose generation has not ended."),
    )
    for name, callback, unit, description in gauges:
        meter.create_observable_gauge(f"conveyor.schedule.{name}", callbacks=[callback],
                                      unit=unit, description=description)

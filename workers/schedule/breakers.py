"""A circuit breaker per infer worker (docs/decisions/0010-breakers-and-fallbacks.md).

After ``failures`` engine failures in a row (a final chunk with
``engine_error``) the breaker opens: the worker gets nothing for
``cooldown_s``, then one probe (half open) whose success closes it and whose
failure opens it again. A success resets the count. Every change of state
is an event on ``conveyor.breakers`` (compacted, keyed by worker id) that
every scheduler follows from its start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import BreakerState
from topics.catalog import BREAKERS
from topics.envelope import now_ms
from topics.follow import Follower, apply_all, follow
from workers.outputs import Output, Sender

__all__ = ["describe", "Breakers", "ENGINE_FAILURE"]

log = logging.getLogger(__name__)

# the error code of a final chunk that counts against the worker
ENGINE_FAILURE = "engine_error"


@dataclass
class Breakers:
    failures: int = 3
    cooldown_s: float = 30.0
    clock: Callable[[], int] = now_ms
    codec: Codec = field(default_factory=default_codec)
    states: dict[str, BreakerState] = field(default_factory=dict)
    # worker id -> the request id of its probe while half open
    probes: dict[str, str] = field(default_factory=dict)
    follower: Follower | None = None
    settings: Settings | None = None
    _writing: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    def of(cls, settings: Settings, clock: Callable[[], int] = now_ms) -> Breakers:
        return cls(settings.schedule.breaker_failures, settings.schedule.breaker_cooldown_s, clock,
                   settings=settings)

    def apply(self, state: BreakerState) -> None:
        """A state read from the topic (this scheduler's or another's)."""
        mine = self.states.get(state["worker_id"])
        if mine is None or state["ts_ms"] >= mine["ts_ms"]:
            self.states[state["worker_id"]] = state

    def allows(self, worker_id: str) -> bool:
        """May a new task go to ``worker_id`` now: closed, or open with its
        cool-down over and no probe out yet."""
        state = self.states.get(worker_id)
        if state is None or state["state"] == "closed":
            return True
        if state["state"] == "half_open":
            return self._probe_lost(state)
        return self.clock() >= state["until_ms"]

    def sent(self, worker_id: str, pool: str, request_id: str) -> BreakerState | None:
        """A task went to ``worker_id``; when the breaker was open, it is the
        probe (the state to publish is returned)."""
        state = self.states.get(worker_id)
        if state is None or state["state"] == "closed":
            return None
        self.probes[worker_id] = request_id
        return self._set(worker_id, pool, "half_open", state["failures"], 0, state["reason"])

    def ended(self, worker_id: str, pool: str, request_id: str, error_code: str | None,
              message: str = "") -> BreakerState | None:
        """A task of ``worker_id`` ended; the state to publish when it changed."""
        state = self.states.get(worker_id)
        was_probe = self.probes.get(worker_id) == request_id
        if was_probe:
            del self.probes[worker_id]
        settled = state is not None and state["state"] != "closed" and not was_probe
        if error_code != ENGINE_FAILURE:
            # a success resets the count; while open, only the probe's counts
            if error_code is not None or state is None or settled:
                return None
            if state["state"] == "closed" and state["failures"] == 0:
                return None
            if state["state"] != "closed":
                log.info("worker %s: its probe succeeded, it gets work again", worker_id)
            return self._set(worker_id, pool, "closed", 0, 0, "")
        if settled:
            return None  # a task sent before the breaker opened: already counted out
        failures = (state["failures"] if state else 0) + 1
        if was_probe or failures >= self.failures:
            log.warning("worker %s: %d engine failures in a row, no work for %.0f s: %s",
                        worker_id, failures, self.cooldown_s, message)
            until = self.clock() + int(self.cooldown_s * 1000)
            return self._set(worker_id, pool, "open", failures, until, message)
        return self._set(worker_id, pool, "closed", failures, 0, message)

    def _probe_lost(self, state: BreakerState) -> bool:
        """Half open, and no outcome of the probe for a cool-down (this
        scheduler restarted, another replica sent it, or its end was never
        heard): another probe may go, one a cool-down at most."""
        return self.clock() >= state["ts_ms"] + int(self.cooldown_s * 1000)

    def _set(self, worker_id: str, pool: str, stage: str, failures: int, until_ms: int,
             reason: str) -> BreakerState:
        state = BreakerState(worker_id=worker_id, pool=pool, state=stage,  # type: ignore[typeddict-item]
                             failures=failures, until_ms=until_ms, reason=reason[:500],
                             ts_ms=self.clock())
        self.states[worker_id] = state
        return state

    def publish(self, sender: Sender | None, state: BreakerState | None) -> None:
        """Write a breaker's new state to ``conveyor.breakers``, in the
        background: this scheduler already acts on it; the log is for the
        others (and for its successor)."""
        if state is None or sender is None or self.settings is None:
            return
        out = Output(BREAKERS.at(self.settings.kafka), "BreakerState", state,
                     key=state["worker_id"])
        task = asyncio.get_running_loop().create_task(sender.produce([out]))
        self._writing.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cannot write a breaker's state: %s", task.exception())

    def report(self) -> dict[str, dict[str, object]]:
        """Every breaker that is not closed, by worker (what ``/healthz`` shows)."""
        now = self.clock()
        return {wid: describe(state, now) for wid, state in sorted(self.states.items())
                if state["state"] != "closed"}

    async def follow(self, ready: asyncio.Event | None = None) -> None:
        """Read the breakers' topic from its start, then keep following it."""
        assert self.settings is not None, "Breakers.of(settings) follows the topic"
        self.follower = follow(self.settings, BREAKERS, 0, "beginning")
        await apply_all(self.follower, self.codec, self.apply,
                        None if ready is None else ready.set)


def describe(state: BreakerState | None, now_ms: int) -> dict[str, object]:
    """A breaker as ``conveyor workers --json`` and ``/healthz`` show it."""
    if state is None:
        return {"state": "closed", "failures": 0, "open_for_s": 0.0, "reason": ""}
    open_for = max(0, state["until_ms"] - now_ms) / 1000 if state["state"] == "open" else 0.0
    return {"state": state["state"], "failures": state["failures"],
            "open_for_s": round(open_for, 1), "reason": state["reason"]}

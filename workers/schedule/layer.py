"""Schedule: send each task to a live worker of its pool with room, interactive
first, each tenant present keeping room for its share; park interactive tasks
(fairly between tenants, or to a fallback's pool) and hold background and
batch ones until a worker has room, their offsets uncommitted
(docs/decisions/0005-schedule-holds-the-queue.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from conveyor.errors import DeadlineExceeded, PermanentBrokerError, RequestError, SchemaError
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import Envelope, ErrorInfo, Task, WorkerHeartbeat
from topics.catalog import ROUTED, infer_topic
from topics.envelope import PRIORITY_INTERACTIVE, now_ms, now_us, stamp
from workers.layer import Layer
from workers.outputs import Output, Sender, failure_reply
from workers.prefix import PrefixIndex, RoutePolicy, WorkerLoad, choose
from workers.schedule.breakers import Breakers
from workers.schedule.held import BatchAdmission, Candidate, Held, HeldQueue
from workers.schedule.outstanding import FinishFollower, Outstanding
from workers.schedule.room import (
    Parked,
    check_deadline,
    expiry_ms,
    has_room,
    interactive_busy,
    kv_need,
    never_fits,
    out_of_time,
    overloaded,
)
from workers.schedule.table import WorkerTable, WorkerView, relative_speeds, serves, warm_first

__all__ = ["ScheduleLayer", "Parked", "fair_order"]

log = logging.getLogger(__name__)


_RECHECK_S = 0.25
_BREAKER_LEVEL = {"closed": 0, "half_open": 1, "open": 2}

Observe = Callable[[CallbackOptions], Iterable[Observation]]


class ScheduleLayer(Layer):
    name = "schedule"
    source = ROUTED
    cancellable = True

    def __init__(self, settings: Settings, table: WorkerTable | None = None,
                 clock: Callable[[], int] = now_ms, *, codec: Codec | None = None) -> None:
        self.settings = settings
        self.table = table or WorkerTable(settings)
        self.parked: list[Parked] = []
        self.held = HeldQueue()
        self.outstanding = Outstanding(clock)
        plan = settings.schedule
        self.admission = BatchAdmission(plan.batch_max_share, plan.batch_prefetch,
                                        plan.interactive_linger_s, clock)
        self.codec = codec or default_codec()
        self.clock = clock
        self.finishes = FinishFollower(settings, self.outstanding.__contains__, self.finished,
                                       self.codec)
        self._sender: Sender | None = None
        self._background: list[asyncio.Task[None]] = []
        # which worker took which prompt blocks (workers/prefix.py)
        self.prefix = PrefixIndex(settings.schedule.route_index_blocks,
                                  settings.schedule.route_index_ttl_s)
        self.table.on_beat = self._heard
        # pool -> tenant -> when its last interactive task came (fair shares)
        self.present: dict[str, dict[str, int]] = {}
        self.weights = plan.weights()
        self.breakers = Breakers.of(settings, clock)
        self.policy = RoutePolicy(plan.route_cache_threshold, plan.route_load_bound,
                                  plan.route_load_weight, plan.route_prefix_aware,
                                  plan.route_load_slack)

    def instrument(self, meter: Meter) -> None:
        """Make schedule's gauges on ``meter``, observing this layer."""

        def breakers(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(_BREAKER_LEVEL.get(s["state"], 0),
                                {"conveyor.worker": s["worker_id"], "conveyor.pool": s["pool"]})
                    for s in list(self.breakers.states.values())]

        def waiting(options: CallbackOptions) -> Iterable[Observation]:
            pools = Counter(p.task["route"]["pool"] for p in list(self.parked))
            for pool in self.table.pools():
                pools.setdefault(pool, 0)
            return [Observation(n, {"conveyor.pool": pool}) for pool, n in pools.items()]

        def held(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(self.held.count(pool), {"conveyor.pool": pool})
                    for pool in {*self.held.pools(), *self.table.pools()}]

        def sent(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(self.outstanding.at(wid), {"conveyor.worker": wid})
                    for wid in list(self.table.workers)]

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

    def _heard(self, beat: WorkerHeartbeat) -> None:
        """A worker's heartbeat: what its cache holds, as it says."""
        if beat["state"] == "stopped":
            self.prefix.forget(beat["worker_id"])
        else:
            self.prefix.reported(beat["worker_id"], beat.get("prefix_blocks"), beat["ts_ms"])

    async def start(self, sender: Sender) -> None:
        """Read the heartbeats and breakers written so far before scheduling (a
        bounded wait: while Kafka cannot be reached, tasks park and say so)."""
        self._sender = sender
        ready, breakers = asyncio.Event(), asyncio.Event()
        follower = asyncio.create_task(self.table.follow(ready), name="worker-table")
        self._background = [
            follower, asyncio.create_task(self.breakers.follow(breakers), name="breakers"),
            asyncio.create_task(self.finishes.run(), name="finishes")]
        waiter: asyncio.Future[Any] = asyncio.gather(ready.wait(), breakers.wait())
        await asyncio.wait([waiter, follower], timeout=self.settings.schedule.no_worker_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if follower.done():
            follower.result()  # surface the failure
        self._background.append(asyncio.create_task(self._place_parked_loop(), name="parked"))

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _check_background(self) -> None:
        for task in self._background:
            if task.done():
                task.result()  # re-raise on the caller, never lost

    async def handle(self, event: Task, record: Any) -> list[Output]:
        self._check_background()
        envelope = stamp(event["envelope"], self.name)
        if event["route"].get("failure") is not None:
            self._failed_before_first_token(event)
        pool = event["route"]["pool"]
        if envelope["priority"] > PRIORITY_INTERACTIVE:
            return self._hold(event, record)
        entered_ms = envelope["stamps"].get("gateway", envelope["stamps"][self.name]) // 1000
        tenant = envelope["tenant"]
        self.present.setdefault(pool, {})[tenant] = self.clock()
        under = self._under_share(pool)
        # else it waits its turn among the parked, unless all of those wait for
        # their tenants' shares and its own tenant runs less than its share
        if not any(p.task["route"]["pool"] == pool for p in self.parked) or (
                under.shared and under(tenant) and not any(
                    p.task["route"]["pool"] == pool
                    and (p.task["envelope"]["tenant"] == tenant
                         or under(p.task["envelope"]["tenant"])) for p in self.parked)):
            placed = None if self._held_back(event, under) else self.place(event)
            if placed is not None:
                return [placed]
        elif sum(p.task["route"]["pool"] == pool and p.task["envelope"]["tenant"] ==
                 envelope["tenant"] for p in self.parked) >= self.settings.schedule.queue_max:
            raise overloaded(event, None)
        tp = TopicPartition(record.topic, record.partition) if record is not None else None
        self.parked.append(Parked(event, tp, record.offset if record is not None else -1,
                                  entered_ms))
        return []

    def _hold(self, task: Task, record: Any) -> list[Output]:
        """A background or batch task: to a worker with room now, if none of its
        pool is held before it; else held until there is room."""
        envelope = task["envelope"]
        check_deadline(envelope, self.clock())
        pool, model = task["route"]["pool"], task["route"]["model"]
        if not self.held.count(pool):
            view = self._room_for_low(pool, model)
            if view is not None:
                return [self._address(task, view)]
        value = getattr(record, "value", None)
        tp = TopicPartition(record.topic, record.partition) if record is not None else None
        self.held.add(Held(
            request_id=envelope["request_id"], pool=pool, priority=envelope["priority"],
            give_up_ms=expiry_ms(envelope, self.settings), tp=tp,
            offset=record.offset if record is not None else -1,
            payload=value if isinstance(value, bytes) else task,
            stamped_us=envelope["stamps"].get(self.name, now_us()), model=model))
        return []

    def place(self, task: Task, overdue: bool = False) -> Output | None:
        """The output sending interactive ``task`` to the worker that
        :func:`workers.prefix.choose` picks among the open ones with room for it
        (room.py); None when none has room. A fallback's pool takes it when its
        own has no open worker, or has given it no room once it is ``overdue``."""
        check_deadline(task["envelope"], self.clock())
        failed = set(task["route"].get("failed_workers") or ())
        opened = [w for w in self._open(task["route"]["pool"], task["route"]["model"])
                  if w.beat["worker_id"] not in failed]
        if (too_big := never_fits(task, opened)) is not None:
            raise too_big
        need = kv_need(task)

        def roomy(workers: list[WorkerView]) -> list[WorkerView]:
            return [w for w in workers if has_room(w, self._interactive_busy(w), need)]

        live = roomy(opened)
        if not live and (overdue or not opened):
            live = self._fall_back(task, roomy)
        if not live:
            return None
        live = warm_first(live, task["route"]["model"])
        speed = relative_speeds(opened)  # a faster worker weighs more
        loads = [WorkerLoad(w.beat["worker_id"], self._busy(w), w.beat["capacity"],
                            speed.get(w.beat["worker_id"], 1.0)) for w in live]
        chosen = choose(loads, task["prompt"]["prefix_blocks"], self.prefix, self.policy,
                        self.clock())
        assert chosen is not None  # there are live workers
        view = next(w for w in live if w.beat["worker_id"] == chosen.worker_id)
        self.admission.interactive_sent(task["route"]["pool"])
        return self._address(task, view)

    def _under_share(self, pool: str) -> UnderShare:
        """Who runs less than its share of ``pool`` now (see :class:`UnderShare`);
        the tenants present there (an interactive task within ``fair_window_s``)
        with their weights, those gone forgotten."""
        seen = self.present.get(pool, {})
        since = self.clock() - int(self.settings.schedule.fair_window_s * 1000)
        for gone in [t for t, at in seen.items() if at <= since]:
            del seen[gone]
        present = {t: self.weights.get(t, 1.0) for t in seen}
        slots = sum(w.beat["capacity"] for w in self._open(pool)) if len(present) > 1 else 0
        return UnderShare(pool, present, slots, self.weights, self.outstanding.of_tenant)

    def _held_back(self, task: Task, under: UnderShare | None = None) -> bool:
        """Whether interactive ``task`` waits so that other tenants find room: its
        tenant runs its share of the pool or more, and the pool has no more free
        slots than the other present tenants under their shares (one each)."""
        pool, tenant = task["route"]["pool"], task["envelope"]["tenant"]
        under = under or self._under_share(pool)
        if under(tenant):
            return False
        keep = sum(1 for other in under.present if other != tenant and under(other))
        if not keep:
            return False
        free = sum(max(0, w.beat["capacity"] - self._interactive_busy(w))
                   for w in self._open(pool))
        return free <= keep

    def _failed_before_first_token(self, task: Task) -> None:
        """A task a worker's engine failed before its first token, sent here again
        (workers/infer/generation.py): the failure counts against that worker's
        breaker and frees its slot here; the task goes to another worker of the
        pool, or a fallback's, and fails with the engine's error at once when
        there is none."""
        route, rid = task["route"], task["envelope"]["request_id"]
        failure = route["failure"]
        assert failure is not None
        self.finished(rid, route["failed_workers"][-1], self.clock(), failure, route["pool"])
        if not self._others_can_take(task):
            raise RequestError(failure["message"], code=failure["code"],
                               status=failure["status"], type=failure["type"],
                               param=failure["param"])

    def _open(self, pool: str, model: str | None = None) -> list[WorkerView]:
        """The live workers of ``pool`` whose breaker lets work through (with
        ``model``: those that serve it)."""
        return [w for w in self.table.live(pool) if self.breakers.allows(w.beat["worker_id"])
                and (model is None or serves(w, model))]

    def _busy(self, view: WorkerView) -> int:
        """A worker's tasks: what its beats tell, never less than what this
        scheduler sent it and has not seen finish."""
        return max(view.busy(), self.outstanding.at(view.beat["worker_id"]))

    def _interactive_busy(self, view: WorkerView) -> int:
        """A worker's tasks less its batch and background ones (room.py)."""
        return interactive_busy(view, self._busy(view),
                                self.outstanding.low_at(view.beat["worker_id"]))

    def _fall_back(self, task: Task, roomy: Callable[[list[WorkerView]], list[WorkerView]]
                   ) -> list[WorkerView]:
        """The workers with room (``roomy``) of the first fallback whose pool has
        some open, the task rerouted there; none: unchanged."""
        route = task["route"]
        for fallback in route.get("fallbacks", []):
            workers = roomy(self._open(fallback["pool"], fallback["model"]))
            if workers:
                log.info("request %s: model %s cannot be served now; %s answers it",
                         task["envelope"]["request_id"], route["model"], fallback["model"])
                route["fallback_from"] = route["model"]
                route["model"], route["pool"] = fallback["model"], fallback["pool"]
                route["fallbacks"] = []
                return workers
        return []

    def _others_can_take(self, task: Task) -> bool:
        """Whether a task an engine failed before its first token has somewhere
        else to go: an open worker of its pool that has not failed it, or a
        fallback with an open worker. Said in the log either way."""
        route = task["route"]
        failed = list(route.get("failed_workers") or ())
        others = [w for w in self._open(route["pool"], route["model"])
                  if w.beat["worker_id"] not in failed]
        fallbacks = [f for f in route.get("fallbacks", []) if self._open(f["pool"], f["model"])]
        failure = route.get("failure")
        log.info("request %s: the engine of worker %s failed before the first token (%s); %s",
                 task["envelope"]["request_id"], failed[-1] if failed else "?",
                 failure["message"] if failure else "",
                 "another worker takes it" if others or fallbacks else "no other can")
        return bool(others or fallbacks)

    def _room_for_low(self, pool: str, model: str | None = None) -> WorkerView | None:
        """The worker the next background or batch task of ``pool`` (asking for
        ``model``) may go to now."""
        live = {w.beat["worker_id"]: w for w in self._open(pool, model)}
        candidates = [Candidate(wid, w.beat["capacity"], self._busy(w))
                      for wid, w in live.items()]
        chosen = self.admission.choose(pool, candidates, self.outstanding.low(pool),
                                       self.outstanding.interactive(pool),
                                       self.table.interactive(pool))
        return live[chosen.worker_id] if chosen is not None else None

    def _address(self, task: Task, view: WorkerView) -> Output:
        envelope = task["envelope"]
        partition = self.table.address(view)
        view.kv_since_beat += kv_need(task)
        self.prefix.took(view.beat["worker_id"], task["prompt"]["prefix_blocks"], self.clock())
        self.breakers.publish(self._sender, self.breakers.sent(
            view.beat["worker_id"], task["route"]["pool"], envelope["request_id"]))
        task["route"]["worker_id"] = view.beat["worker_id"]
        task["route"]["partition"] = partition
        self.outstanding.add(envelope["request_id"], view.beat["worker_id"],
                             task["route"]["pool"], envelope["priority"],
                             expiry_ms(envelope, self.settings), envelope["tenant"])
        return Output(infer_topic(self.settings.kafka, task["route"]["pool"]), "Task", task,
                      key=envelope["request_id"], partition=partition)

    def finished(self, request_id: str, worker_id: str, written_ms: int,
                 error: ErrorInfo | None = None, pool: str | None = None) -> None:
        """A generation this scheduler sent ended (its final chunk was written
        at ``written_ms`` by ``worker_id``): its slot is free, and its breaker
        hears how it went. With ``pool``, the breaker hears it even when
        another scheduler sent it (a task failed before its first token)."""
        sent = self.outstanding.forget(request_id)
        if sent is not None:
            self.table.finished(worker_id, written_ms)
            self.table.changed.set()
        if sent is not None or pool is not None:
            self.breakers.publish(self._sender, self.breakers.ended(
                worker_id, sent.pool if sent is not None else str(pool), request_id,
                error["code"] if error else None, error["message"] if error else ""))

    def cancel(self, request_id: str) -> None:
        """Drop the parked or held task of a cancelled request (its offset is
        released); a task already sent no longer counts on its worker."""
        self.parked = [p for p in self.parked if p.task["envelope"]["request_id"] != request_id]
        self.held.remove(request_id)
        sent = self.outstanding.forget(request_id)
        if sent is not None:  # the worker stops it
            self.table.finished(sent.worker_id, self.clock())
            self.table.changed.set()

    async def place_parked(self) -> None:
        """Send every parked task that now has a worker; fail those out of time."""
        sender = self._sender
        assert sender is not None
        blocked: set[str] = set()
        for parked in fair_order(self.parked, self.outstanding.of_tenant):
            if not any(p is parked for p in self.parked):
                continue  # cancelled while an earlier one was being sent
            pool = parked.task["route"]["pool"]
            outputs: list[Output] = []
            try:
                served = bool(self._open(pool))  # by live workers, with no room
                overdue = self.clock() >= parked.give_up_ms(self.settings, served)
                # never refused for want of room while a slot is kept for others
                held_back = not overdue and self._held_back(parked.task)
                out = None if pool in blocked or held_back else self.place(parked.task, overdue)
                if out is None and overdue:
                    raise out_of_time(parked, served, self.table.settling(), self.settings)
            except RequestError as exc:
                outputs = sender.error_outputs(parked.task["envelope"], exc,
                                               parked.task["generation"])
            else:
                if out is None:
                    if not held_back:  # later tasks of the pool stay behind this one
                        blocked.add(pool)
                    continue
                outputs = [out]
            await self._deliver(sender, parked.task["envelope"], outputs)
            # handle() may have parked more, or a cancel dropped some, meanwhile
            self.parked = [p for p in self.parked if p is not parked]

    async def release_held(self) -> None:
        """Fail the held tasks out of time; send the next ones while workers
        have room for them."""
        sender = self._sender
        assert sender is not None
        sends: list[tuple[Envelope, list[Output]]] = []
        for late in self.held.expired(self.clock()):
            task = late.task(self.codec, self.name)
            exc = DeadlineExceeded("The request's deadline passed while it waited for a "
                                   "worker with room for it.")
            sends.append((task["envelope"],
                          sender.error_outputs(task["envelope"], exc, task["generation"])))
        for pool in self.held.pools():
            while (upcoming := self.held.peek(pool)) is not None:
                view = self._room_for_low(pool, upcoming.model or None)
                if view is None:
                    break
                held = self.held.pop(pool)
                if held is None:
                    break
                task = held.task(self.codec, self.name)
                sends.append((task["envelope"], [self._address(task, view)]))
        await asyncio.gather(*(self._deliver(sender, env, outs) for env, outs in sends))

    async def _deliver(self, sender: Sender, envelope: Envelope, outputs: list[Output]) -> None:
        """Produce a task's outcome; what can never be produced fails the request."""
        try:
            await sender.produce(outputs)
        except (PermanentBrokerError, SchemaError) as exc:
            log.error("request %s: cannot send its task: %s", envelope["request_id"], exc)
            self.outstanding.forget(envelope["request_id"])
            with contextlib.suppress(PermanentBrokerError, SchemaError):
                await sender.produce(sender.error_outputs(envelope, failure_reply(exc, self.name)))

    def reconcile(self) -> None:
        """Let new heartbeats correct the count of tasks sent (see outstanding;
        the beat's time is the worker's clock, the entries' the scheduler's)."""
        slack_ms = int(2 * self.settings.infer.heartbeat_interval_s * 1000) + \
            self.settings.process.clock_skew_ms
        self.outstanding.reconcile_beats([v.beat for v in self.table.workers.values()],
                                         slack_ms)

    async def _place_parked_loop(self) -> None:
        while True:
            self.table.changed.clear()
            self.reconcile()
            if self.parked:
                await self.place_parked()
            if len(self.held):
                await self.release_held()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.table.changed.wait(), _RECHECK_S)

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """Never commit past a task still parked or held on ``tp``."""
        held = self.held.low(tp)
        return min([next_offset, *(p.offset for p in self.parked if p.tp == tp),
                    *([held] if held is not None else [])])

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """This member's partitions now: its part of the batch share."""
        total = max(1, self.settings.kafka.pipeline_partitions)
        self.admission.fraction = min(1.0, len(partitions) / total)

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """Tasks parked or held from those partitions are the new owner's."""
        gone = set(partitions)
        self.parked = [p for p in self.parked if p.tp not in gone]
        self.held.revoked(gone)


@dataclass
class UnderShare:
    """Whether a tenant runs less than its share of a pool's ``slots``, rounded
    up (``running(pool, tenant)``): shares are the ``present`` tenants'
    weights over their sum; every tenant is under while fewer than two are
    present (``shared`` False)."""

    pool: str
    present: dict[str, float]
    slots: int
    weights: dict[str, float]
    running: Callable[[str, str], int]

    @property
    def shared(self) -> bool:
        return len(self.present) > 1

    def __call__(self, tenant: str) -> bool:
        if not self.shared:
            return True
        weight = self.present.get(tenant, self.weights.get(tenant, 1.0))
        total = sum(self.present.values()) + (tenant not in self.present) * weight
        return self.running(self.pool, tenant) < math.ceil(self.slots * weight / total)


def fair_order(parked: list[Parked], running: Callable[[str, str], int]) -> list[Parked]:
    """``parked`` in the order they are offered room: in each pool, the next
    task is the oldest of the tenant with the fewest tasks running
    (``running(pool, tenant)``) plus taken before it in this order, so tenants
    take turns; a tenant's own tasks keep their arrival order."""
    queues: dict[tuple[str, str], list[Parked]] = {}
    for p in parked:
        queues.setdefault((p.task["route"]["pool"], p.task["envelope"]["tenant"]), []).append(p)
    taken = {key: running(*key) for key in queues}
    arrival = {id(p): i for i, p in enumerate(parked)}
    out: list[Parked] = []
    while queues:
        key = min(queues, key=lambda k: (taken[k], arrival[id(queues[k][0])]))
        out.append(queues[key].pop(0))
        taken[key] += 1
        if not queues[key]:
            del queues[key]
    return out

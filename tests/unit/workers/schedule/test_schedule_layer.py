"""ScheduleLayer: placing tasks, parking them while a pool has no live worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition

from conveyor.errors import RequestError
from conveyor.settings import Settings, load_settings
from schemas.records import Task, WorkerHeartbeat
from tests.support.schedule_tasks import RecordingSender, indexed_workers
from topics.envelope import new_envelope, now_ms
from workers.schedule.layer import ScheduleLayer, fair_order
from workers.schedule.room import Parked


@dataclass
class BlindFollower:
    """The follower's view a WorkerTable reads (reachable, last contact, regained)."""

    reachable: bool = False
    last_contact_ms: int = 0
    regained_ms: int = 0


@dataclass
class Rec:
    topic: str
    partition: int
    offset: int


def task(rid: str, pool: str = "cpu", deadline_ms: int = 0) -> Task:
    env = new_envelope(rid, reply_gateway="g", reply_partition=0, deadline_ms=deadline_ms)
    prompt = {"prefix_blocks": [], "tokens": 12, "max_tokens": 8}
    return Task(envelope=env, generation={}, prompt=prompt,  # type: ignore[typeddict-item]
                route={"model": "m", "pool": pool, "worker_id": "", "partition": -1})


def beat(worker: str, pool: str = "cpu", partitions: list[int] | None = None) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker, pool=pool, engine="e", models=[], state="ready",
                           partitions=partitions or [3], capacity=2, running=0, queued=0,
                           ts_ms=now_ms(), host="h", gpu_utilization=None, gpu_memory_free=None,
                           interactive_running=0, interactive_ms=0)


@pytest.fixture
def settings() -> Settings:
    return load_settings(topic_prefix="sched", no_worker_timeout_s=5)


@pytest.fixture
def layer(settings: Settings) -> tuple[ScheduleLayer, RecordingSender]:
    layer = ScheduleLayer(settings)
    sender = RecordingSender()
    layer._sender = sender  # type: ignore[assignment]
    return layer, sender


async def test_a_live_worker_gets_the_task_on_its_partition(layer: Any) -> None:
    sched, _ = layer
    sched.table.apply(beat("w1", partitions=[5]))
    [out] = await sched.handle(task("r1"), Rec("sched.routed", 0, 7))
    assert out.topic == "sched.infer.cpu" and out.partition == 5
    assert out.record["route"]["worker_id"] == "w1"
    assert sched.committable(TopicPartition("sched.routed", 0), 8) == 8


async def test_without_a_worker_the_task_is_parked_and_its_offset_held(layer: Any) -> None:
    sched, sender = layer
    tp = TopicPartition("sched.routed", 0)
    assert await sched.handle(task("r1"), Rec(tp.topic, 0, 7)) == []
    assert sched.committable(tp, 8) == 7
    # another pool is not held up
    sched.table.apply(beat("g1", pool="gpu"))
    [out] = await sched.handle(task("r2", pool="gpu"), Rec(tp.topic, 0, 8))
    assert out.topic == "sched.infer.gpu"
    # a worker appears: the parked task goes out, and the offset moves on
    sched.table.apply(beat("w1"))
    await sched.place_parked()
    assert [o.record["envelope"]["request_id"] for o in sender.sent] == ["r1"]
    assert sched.committable(tp, 9) == 9


async def test_parked_tasks_keep_their_order(layer: Any) -> None:
    sched, sender = layer
    await sched.handle(task("r1"), Rec("sched.routed", 0, 1))
    sched.table.apply(beat("w1"))
    # r2 arrives after the worker did, but r1 was waiting first
    assert await sched.handle(task("r2"), Rec("sched.routed", 0, 2)) == []
    await sched.place_parked()
    assert [o.record["envelope"]["request_id"] for o in sender.sent] == ["r1", "r2"]


async def test_a_task_parked_too_long_fails_with_503(settings: Settings) -> None:
    clock = [now_ms()]
    sched = ScheduleLayer(settings, clock=lambda: clock[0])
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    await sched.handle(task("r1"), Rec("sched.routed", 0, 1))
    await sched.place_parked()
    assert sender.errors == [] and len(sched.parked) == 1
    clock[0] += 6000
    await sched.place_parked()
    [(rid, error)] = sender.errors
    assert rid == "r1" and error["status"] == 503 and error["code"] == "no_worker_available"
    assert sched.parked == []


async def test_a_past_deadline_fails_with_504(layer: Any) -> None:
    from conveyor.errors import DeadlineExceeded

    sched, _ = layer
    sched.table.apply(beat("w1"))
    with pytest.raises(DeadlineExceeded):
        await sched.handle(task("r1", deadline_ms=now_ms() - 1), Rec("sched.routed", 0, 1))


async def test_revoked_partitions_drop_their_parked_tasks(layer: Any) -> None:
    sched, _ = layer
    await sched.handle(task("r1"), Rec("sched.routed", 0, 1))
    await sched.handle(task("r2"), Rec("sched.routed", 1, 1))
    sched.revoked([TopicPartition("sched.routed", 0)])
    assert [p.task["envelope"]["request_id"] for p in sched.parked] == ["r2"]


async def test_a_cancelled_parked_task_is_never_sent(layer: Any) -> None:
    sched, sender = layer
    tp = TopicPartition("sched.routed", 0)
    await sched.handle(task("r1"), Rec(tp.topic, 0, 1))
    await sched.handle(task("r2"), Rec(tp.topic, 0, 2))  # queued behind r1
    await sched.handle(task("r3"), Rec(tp.topic, 0, 3))
    sched.cancel("r1")
    sched.cancel("r2")
    assert sched.committable(tp, 4) == 3  # the cancelled ones no longer hold the offset
    sched.table.apply(beat("w1"))
    await sched.place_parked()
    assert [o.record["envelope"]["request_id"] for o in sender.sent] == ["r3"]
    assert sender.errors == []


async def test_a_blind_table_says_the_pipeline_is_unavailable(settings: Settings) -> None:
    clock = [now_ms()]
    sched = ScheduleLayer(settings, clock=lambda: clock[0])
    sched.table.clock = lambda: clock[0]
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    # the worker beat just before the table lost sight of Kafka
    sched.table.apply(beat("w1"))
    sched.table.follower = BlindFollower(last_contact_ms=clock[0])  # type: ignore[assignment]
    clock[0] += 60_000
    # not declared dead because of the table's own blindness
    assert [w.beat["worker_id"] for w in sched.table.live("cpu")] == ["w1"]
    assert sched.table.settling()
    # a task out of time while blind: 503 pipeline_unavailable, not no_worker_available
    await sched.handle(task("r1", pool="gpu"), Rec("sched.routed", 0, 1))
    clock[0] += 6000
    await sched.place_parked()
    [(rid, error)] = sender.errors
    assert rid == "r1" and error["status"] == 503 and error["code"] == "pipeline_unavailable"


async def test_a_table_that_sees_again_settles_after_a_ttl(settings: Settings) -> None:
    clock = [now_ms()]
    sched = ScheduleLayer(settings, clock=lambda: clock[0])
    sched.table.clock = lambda: clock[0]
    sched.table.follower = BlindFollower(  # type: ignore[assignment]
        reachable=True, last_contact_ms=clock[0], regained_ms=clock[0])
    assert sched.table.settling()
    clock[0] += int(settings.schedule.worker_ttl_s * 1000) + 1
    assert not sched.table.settling()
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    await sched.handle(task("r1", pool="gpu"), Rec("sched.routed", 0, 1))
    clock[0] += 6000
    await sched.place_parked()
    [(_, error)] = sender.errors
    assert error["code"] == "no_worker_available"


async def test_a_task_goes_where_a_heartbeat_says_its_prefix_is(layer: Any) -> None:
    """What a worker's cache holds comes from its heartbeat, not only from what
    this scheduler sent (another replica's work, or work sent before a restart);
    a stopped worker's blocks are forgotten."""
    sched, _ = layer
    sched.table.apply(beat("w0", partitions=[0]))
    holder = beat("w1", partitions=[1])
    holder["prefix_blocks"] = [11, 12, 13]
    sched.table.apply(holder)
    t = task("r1")
    t["prompt"]["prefix_blocks"] = [11, 12, 13, 14]
    out = sched.place(t)
    assert out is not None and out.partition == 1
    holder = beat("w1", partitions=[1])
    holder["state"] = "stopped"
    sched.table.apply(holder)
    assert indexed_workers(sched.prefix) == []


def tenant_task(rid: str, tenant: str) -> Task:
    made = task(rid)
    made["envelope"]["tenant"] = tenant
    return made


async def test_a_tenants_first_request_is_not_starved_by_anothers_flood(layer: Any) -> None:
    """Tenant a fills the worker's two slots and parks eight more; tenant b's one
    request, parked after them, takes the first slot that frees."""
    sched, sender = layer
    sched.table.apply(beat("w1"))
    for i in range(10):
        await sched.handle(tenant_task(f"a{i}", "a"), Rec("sched.routed", 0, i))
    await sched.handle(tenant_task("b0", "b"), Rec("sched.routed", 0, 10))
    assert sender.sent == []  # a0 and a1 went out as handle()'s outputs
    assert len(sched.parked) == 9
    sched.finished("a0", "w1", now_ms())
    await sched.place_parked()
    assert [o.record["envelope"]["request_id"] for o in sender.sent] == ["b0"]
    sched.finished("a1", "w1", now_ms())
    await sched.place_parked()
    assert [o.record["envelope"]["request_id"] for o in sender.sent] == ["b0", "a2"]


async def test_the_queue_limit_is_a_tenants_own(settings: Settings) -> None:
    sched = ScheduleLayer(settings.replace(schedule_queue_max=2))
    sched._sender = RecordingSender()  # type: ignore[assignment]
    for i in range(2):
        await sched.handle(tenant_task(f"a{i}", "a"), Rec("sched.routed", 0, i))
    with pytest.raises(RequestError, match="overloaded|capacity"):
        await sched.handle(tenant_task("a2", "a"), Rec("sched.routed", 0, 2))
    assert await sched.handle(tenant_task("b0", "b"), Rec("sched.routed", 0, 3)) == []


def test_fair_order_takes_turns_and_counts_what_runs() -> None:
    parked = [Parked(tenant_task(rid, rid[0]), None, i, 0)
              for i, rid in enumerate(["a0", "a1", "a2", "b0", "b1", "c0"])]
    order = fair_order(parked, lambda pool, tenant: {"a": 0, "b": 1, "c": 3}[tenant])
    assert [p.task["envelope"]["request_id"] for p in order] == [
        "a0", "a1", "b0", "a2", "b1", "c0"]


def sent_ids(outputs: list[Any]) -> list[str]:
    return [o.record["envelope"]["request_id"] for o in outputs]


def finish(sched: ScheduleLayer, request_id: str) -> None:
    """The generation of ``request_id`` ends on the worker it was sent to."""
    sched.finished(request_id, sched.outstanding._by_id[request_id].worker_id, now_ms())


async def flood(sched: ScheduleLayer, tenant: str, n: int, first_offset: int = 0) -> list[str]:
    """``n`` tasks of ``tenant``: the ids handle() sent at once."""
    out: list[str] = []
    for i in range(n):
        out += sent_ids(await sched.handle(tenant_task(f"{tenant}{i}", tenant),
                                           Rec("sched.routed", 0, first_offset + i)))
    return out


async def test_a_present_tenant_finds_a_slot_kept_beside_anothers_flood(
        settings: Settings) -> None:
    """Four slots: tenant b asked lately, so tenant a's flood takes three of them
    and b's next request goes out at once, not after a slot frees."""
    clock = [now_ms()]
    sched = ScheduleLayer(settings, clock=lambda: clock[0])
    sched._sender = RecordingSender()  # type: ignore[assignment]
    sched.table.apply(beat("w1", partitions=[1]))
    sched.table.apply(beat("w2", partitions=[2]))
    assert await flood(sched, "b", 1) == ["b0"]
    finish(sched, "b0")
    assert await flood(sched, "a", 6, 10) == ["a0", "a1", "a2"]
    assert len(sched.parked) == 3
    [out] = await sched.handle(tenant_task("b1", "b"), Rec("sched.routed", 0, 20))
    assert sent_ids([out]) == ["b1"]
    # a slot frees: it stays b's while b runs less than its half
    finish(sched, "a0")
    await sched.place_parked()
    assert sched._sender.sent == []  # type: ignore[attr-defined]
    # b's request ends: two free, one kept for b, one for a
    finish(sched, "b1")
    await sched.place_parked()
    assert sent_ids(sched._sender.sent) == ["a3"]  # type: ignore[attr-defined]


async def test_a_tenant_alone_takes_every_slot_once_the_others_are_gone(
        settings: Settings) -> None:
    clock = [now_ms()]
    sched = ScheduleLayer(settings, clock=lambda: clock[0])
    sched._sender = RecordingSender()  # type: ignore[assignment]
    sched.table.apply(beat("w1", partitions=[1]))
    sched.table.apply(beat("w2", partitions=[2]))
    await flood(sched, "b", 1)
    finish(sched, "b0")
    assert await flood(sched, "a", 4, 10) == ["a0", "a1", "a2"]
    clock[0] += int(settings.schedule.fair_window_s * 1000) + 1
    await sched.place_parked()
    assert sent_ids(sched._sender.sent) == ["a3"]  # type: ignore[attr-defined]


async def test_a_task_kept_back_for_a_share_blocks_no_other_tenant(settings: Settings) -> None:
    """Four slots, b weighing three to a's one. a's parked task, first in turn,
    waits for its share; b's parked behind it takes the slot that frees."""
    sched = ScheduleLayer(settings.replace(schedule_tenant_shares="b=3"))
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    sched.table.apply(beat("w1", partitions=[1]))
    sched.table.apply(beat("w2", partitions=[2]))
    assert await flood(sched, "a", 1) == ["a0"]
    assert await flood(sched, "b", 3, 10) == ["b0", "b1", "b2"]
    await sched.handle(tenant_task("a1", "a"), Rec("sched.routed", 0, 20))
    await sched.handle(tenant_task("b3", "b"), Rec("sched.routed", 0, 21))
    assert len(sched.parked) == 2
    finish(sched, "b0")
    await sched.place_parked()
    assert sent_ids(sender.sent) == ["b3"]


async def test_tenant_shares_weigh_what_a_tenant_may_run(settings: Settings) -> None:
    """Four slots, a running one, b two: with equal shares b's third task waits
    for a's share; weighing b three to a's one, it goes."""
    for shares, expected in (("", []), ("b=3", ["b2"])):
        sched = ScheduleLayer(settings.replace(schedule_tenant_shares=shares))
        sched._sender = RecordingSender()  # type: ignore[assignment]
        sched.table.apply(beat("w1", partitions=[1]))
        sched.table.apply(beat("w2", partitions=[2]))
        assert await flood(sched, "a", 1) == ["a0"]
        assert await flood(sched, "b", 2, 10) == ["b0", "b1"]
        assert sent_ids(await sched.handle(tenant_task("b2", "b"),
                                           Rec("sched.routed", 0, 20))) == expected


def test_tenant_shares_are_read_or_refused() -> None:
    assert load_settings(schedule_tenant_shares=" acme=3, beta=0.5 ").schedule.weights() == {
        "acme": 3.0, "beta": 0.5}
    for bad in ("acme", "acme=0", "acme=-1", "=2", "acme=x", "acme=nan"):
        with pytest.raises(ValueError, match="tenant share"):
            load_settings(schedule_tenant_shares=bad)


async def test_a_slot_kept_for_a_share_never_refuses_a_task_that_waited_out(
        settings: Settings) -> None:
    """Two slots, b present: a's second task waits for b's share, and when it
    would be refused for want of room it takes the kept slot instead."""
    clock = [now_ms()]
    sched = ScheduleLayer(settings, clock=lambda: clock[0])
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    sched.table.apply(beat("w1", partitions=[1]))
    await flood(sched, "b", 1)
    finish(sched, "b0")
    assert await flood(sched, "a", 2, 10) == ["a0"]
    await sched.place_parked()
    assert sender.sent == [] and sender.errors == []
    clock[0] += int(settings.schedule.timeout_s * 1000)
    sched.table.apply(beat("w1", partitions=[1]))  # still live by the clock
    await sched.place_parked()
    assert sent_ids(sender.sent) == ["a1"] and sender.errors == []


async def test_a_pool_too_small_to_share_is_not_kept_idle(settings: Settings) -> None:
    """One slot between two tenants: a share of a half rounds up to the slot."""
    sched = ScheduleLayer(settings)
    sched._sender = RecordingSender()  # type: ignore[assignment]
    sched.table.apply(WorkerHeartbeat(**{**beat("w1"), "capacity": 1}))  # type: ignore[typeddict-item]
    await flood(sched, "b", 1)
    finish(sched, "b0")
    assert await flood(sched, "a", 1, 10) == ["a0"]


async def test_a_new_task_does_not_pass_a_parked_one_of_a_tenant_under_its_share(
        settings: Settings) -> None:
    """Six slots, three tenants present (two each): b's task parked while the
    pool was full. When one of c's ends, c's next task (c under its share too,
    and running no fewer than b) waits its turn behind b's instead of taking the
    freed slot before schedule offers it."""
    sched = ScheduleLayer(settings)
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    for i in range(3):
        sched.table.apply(beat(f"w{i}", partitions=[i]))
    await flood(sched, "b", 1)
    finish(sched, "b0")
    assert await flood(sched, "c", 2, 10) == ["c0", "c1"]
    assert await flood(sched, "a", 4, 20) == ["a0", "a1", "a2"]  # a3 kept back for b
    assert sent_ids(await sched.handle(tenant_task("b1", "b"), Rec("sched.routed", 0, 30))) \
        == ["b1"]
    assert await sched.handle(tenant_task("b2", "b"), Rec("sched.routed", 0, 31)) == []
    finish(sched, "c1")
    assert await sched.handle(tenant_task("c9", "c"), Rec("sched.routed", 0, 32)) == []
    await sched.place_parked()
    assert sent_ids(sender.sent) == ["b2"]

"""Fallbacks: route lists a model's fallbacks that fit the prompt, schedule
sends a task to the first one whose pool can take it, and the worker answers
under the fallback's name with its own chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.errors import RequestError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from schemas.records import Prepared
from tests.support.schedule_tasks import RecordingSender, beat, full_task
from workers.infer.generation import request_from_task
from workers.route.layer import RouteLayer
from workers.schedule.breakers import ENGINE_FAILURE
from workers.schedule.layer import ScheduleLayer

MODELS = '''
[models."big"]
pool = "gpu"
context_length = 8192
fallbacks = ["small", "tiny"]
[models."small"]
pool = "cpu"
context_length = 2048
[models."tiny"]
pool = "edge"
context_length = 512
'''


async def test_route_lists_the_fallbacks_the_prompt_fits(tmp_path: Path) -> None:
    (tmp_path / "models.toml").write_text(MODELS)
    layer = RouteLayer(load_settings(topic_prefix="r"), Registry.load(tmp_path / "models.toml"))
    task = full_task("r1")
    prepared = Prepared(envelope=task["envelope"], generation={**task["generation"],
                                                               "model": "big"},
                        prompt={**task["prompt"], "tokens": 1000, "max_tokens": 256})
    [out] = await layer.handle(prepared, None)
    route = out.record["route"]
    assert (route["model"], route["pool"]) == ("big", "gpu")
    assert route["fallbacks"] == [{"model": "small", "pool": "cpu"}]  # 1,256 > tiny's 512
    assert route["fallback_from"] == ""


def schedule() -> ScheduleLayer:
    sched = ScheduleLayer(load_settings(topic_prefix="s"))
    sched._sender = RecordingSender()  # type: ignore[assignment]
    return sched


def big_task(rid: str) -> dict:  # type: ignore[type-arg]
    task = full_task(rid, pool="gpu")
    task["route"]["model"] = "big"
    task["route"]["fallbacks"] = [{"model": "small", "pool": "cpu"},
                                  {"model": "tiny", "pool": "edge"}]
    return task  # type: ignore[return-value]


def test_a_task_whose_pool_has_no_worker_goes_to_the_first_fallback_that_has_one() -> None:
    sched = schedule()
    sched.table.apply(beat("e0", pool="edge", partitions=[2]))
    out = sched.place(big_task("f1"))  # type: ignore[arg-type]
    assert out is not None and out.topic == "s.infer.edge"
    route = out.record["route"]
    assert (route["model"], route["pool"], route["fallback_from"]) == ("tiny", "edge", "big")
    sched.table.apply(beat("c0", pool="cpu", partitions=[1]))
    assert sched.place(big_task("f2")).record["route"]["model"] == "small"  # type: ignore[arg-type, union-attr]
    sched.table.apply(beat("g0", pool="gpu", partitions=[0]))
    own = sched.place(big_task("f3"))  # type: ignore[arg-type]
    assert own is not None and own.record["route"]["model"] == "big"
    assert not own.record["route"].get("fallback_from")


async def test_a_pool_whose_breakers_are_all_open_falls_back() -> None:
    sched = schedule()
    sched.table.apply(beat("g0", pool="gpu", partitions=[0], capacity=8))
    sched.table.apply(beat("c0", pool="cpu", partitions=[1], capacity=8))
    for _ in range(3):
        sched.breakers.ended("g0", "gpu", "x", ENGINE_FAILURE)
    out = sched.place(big_task("f1"))  # type: ignore[arg-type]
    assert out is not None and out.record["route"]["model"] == "small"


def test_without_a_fallback_that_can_take_it_the_task_parks() -> None:
    sched = schedule()
    assert sched.place(big_task("f1")) is None  # type: ignore[arg-type]


def test_the_worker_answers_as_the_fallback_with_its_own_template() -> None:
    task = big_task("f1")
    task["route"].update(model="small", pool="cpu", fallback_from="big", fallbacks=[])
    request = request_from_task(task, "", 0, None)  # type: ignore[arg-type]
    assert request.model == "small"
    assert request.prompt_text is None  # rendered for "big": the engine renders for itself
    plain = request_from_task(full_task("p1"), "", 0, None)
    assert plain.prompt_text == full_task("p1")["prompt"]["text"]


def failed_on(task: dict, *workers: str) -> dict:  # type: ignore[type-arg]
    """``task`` as a worker sends it back when its engine failed before the first token."""
    task["route"]["failed_workers"] = list(workers)
    task["route"]["failure"] = {"status": 500, "type": "server_error", "code": ENGINE_FAILURE,
                                "param": None, "message": "the engine broke"}
    return task


async def test_a_task_failed_before_its_first_token_goes_to_another_worker() -> None:
    sched = schedule()
    sched.table.apply(beat("g0", pool="gpu", partitions=[0], capacity=8))
    sched.table.apply(beat("g1", pool="gpu", partitions=[1], capacity=8))
    for attempt in range(3):
        out = await sched.handle(failed_on(big_task(f"r{attempt}"), "g0"), None)  # type: ignore[arg-type]
        assert [o.record["route"]["worker_id"] for o in out] == ["g1"]
    # each failure counted against g0's breaker: it is open now
    assert not sched.breakers.allows("g0") and sched.breakers.allows("g1")


async def test_with_no_other_worker_it_falls_back_or_fails_with_the_engines_error() -> None:
    sched = schedule()
    sched.table.apply(beat("g0", pool="gpu", partitions=[0], capacity=8))
    sched.table.apply(beat("c0", pool="cpu", partitions=[1], capacity=8))
    [out] = await sched.handle(failed_on(big_task("r1"), "g0"), None)  # type: ignore[arg-type]
    route = out.record["route"]
    assert (route["model"], route["worker_id"], route["fallback_from"]) == ("small", "c0", "big")
    alone = big_task("r2")
    alone["route"]["fallbacks"] = []
    with pytest.raises(RequestError) as info:
        await sched.handle(failed_on(alone, "g0"), None)  # type: ignore[arg-type]
    assert info.value.code == ENGINE_FAILURE and info.value.message == "the engine broke"

"""Circuit breakers: three engine failures in a row open one, a cool-down later
one probe decides; other errors are not the worker's."""

from __future__ import annotations

import asyncio

from conveyor.settings import load_settings
from schemas.codec import default_codec
from tests.support.schedule_tasks import RecordingSender, beat, full_task
from topics.envelope import now_ms
from workers.schedule.breakers import ENGINE_FAILURE, Breakers
from workers.schedule.layer import ScheduleLayer


class Clock:
    def __init__(self) -> None:
        self.ms = now_ms()

    def __call__(self) -> int:
        return self.ms


def stage(b: Breakers, worker: str) -> str:
    state = b.states.get(worker)
    return "closed" if state is None else state["state"]


def failing(b: Breakers, worker: str, times: int, first: int = 0) -> None:
    for i in range(times):
        b.sent(worker, "cpu", f"r{first + i}")
        b.ended(worker, "cpu", f"r{first + i}", ENGINE_FAILURE, "upstream refused")


def test_three_failures_in_a_row_open_it_until_the_cool_down_then_one_probe() -> None:
    clock = Clock()
    b = Breakers(failures=3, cooldown_s=30, clock=clock)
    failing(b, "w0", 2)
    assert b.allows("w0") and stage(b, "w0") == "closed"
    failing(b, "w0", 1, first=2)
    assert stage(b, "w0") == "open" and not b.allows("w0")
    assert b.states["w0"]["reason"] == "upstream refused"
    clock.ms += 29_000
    assert not b.allows("w0")
    clock.ms += 1_000
    assert b.allows("w0")
    probe = b.sent("w0", "cpu", "probe")
    assert probe is not None and probe["state"] == "half_open"
    assert not b.allows("w0")  # one probe at a time
    closed = b.ended("w0", "cpu", "probe", None)
    assert closed is not None and closed["state"] == "closed" and closed["failures"] == 0
    assert b.allows("w0")


def test_a_failed_probe_opens_it_for_another_cool_down() -> None:
    clock = Clock()
    b = Breakers(failures=3, cooldown_s=10, clock=clock)
    failing(b, "w0", 3)
    clock.ms += 10_000
    b.sent("w0", "cpu", "probe")
    reopened = b.ended("w0", "cpu", "probe", ENGINE_FAILURE, "still down")
    assert reopened is not None and reopened["state"] == "open"
    assert reopened["until_ms"] == clock.ms + 10_000 and not b.allows("w0")


def test_a_success_resets_the_count_and_other_errors_do_not_count() -> None:
    b = Breakers(failures=3, clock=Clock())
    failing(b, "w0", 2)
    assert b.ended("w0", "cpu", "ok", None) is not None  # back to 0: published
    failing(b, "w0", 2, first=10)
    for code in ("deadline_exceeded", "invalid_request_error", "cancelled"):
        assert b.ended("w0", "cpu", "x", code) is None
    assert stage(b, "w0") == "closed" and b.states["w0"]["failures"] == 2


def test_tasks_sent_before_it_opened_do_not_decide() -> None:
    clock = Clock()
    b = Breakers(failures=3, cooldown_s=10, clock=clock)
    failing(b, "w0", 3)
    assert b.ended("w0", "cpu", "older-ok", None) is None  # only the probe closes it
    assert b.ended("w0", "cpu", "older-failed", ENGINE_FAILURE) is None
    assert stage(b, "w0") == "open"


def test_a_state_from_the_log_is_taken_unless_older_than_its_own() -> None:
    clock = Clock()
    b = Breakers(clock=clock)
    opened = Breakers(clock=clock)
    failing(opened, "w0", 3)
    b.apply(opened.states["w0"])  # another replica's, or a predecessor's
    assert not b.allows("w0")
    stale = {**opened.states["w0"], "state": "closed", "ts_ms": clock.ms - 1}
    b.apply(stale)  # type: ignore[arg-type]
    assert stage(b, "w0") == "open"
    # a probe sent by someone else that never reported: another may go a cool-down later
    half = {**opened.states["w0"], "state": "half_open", "ts_ms": clock.ms}
    b.apply(half)  # type: ignore[arg-type]
    assert not b.allows("w0")
    clock.ms += 30_000
    assert b.allows("w0")
    assert default_codec().decode(default_codec().encode("BreakerState", half),
                                  "BreakerState") == half


async def test_schedule_sends_nothing_to_an_open_worker_and_probes_it_later() -> None:
    clock = Clock()
    sched = ScheduleLayer(load_settings(topic_prefix="sched", breaker_cooldown_s=5), clock=clock)
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    sched.table.apply(beat("w0", partitions=[0], capacity=4))
    sched.table.apply(beat("w1", partitions=[1], capacity=4))

    def place(rid: str) -> str:
        out = sched.place(full_task(rid))
        assert out is not None
        return str(out.record["route"]["worker_id"])

    error = {"status": 500, "type": "server_error", "code": ENGINE_FAILURE, "param": None,
             "message": "the engine failed"}
    for i in range(3):
        assert place(f"f{i}") == "w0"  # least loaded, ties to w0
        sched.finished(f"f{i}", "w0", now_ms() + 1, error)  # type: ignore[arg-type]
    assert [place(f"n{i}") for i in range(4)] == ["w1"] * 4  # w0 is open
    for i in range(4):
        sched.finished(f"n{i}", "w1", now_ms() + 1)
    clock.ms += 5_000  # the breakers' clock (the table's is the real one)
    assert place("probe") == "w0"
    assert place("after") == "w1"  # the probe is out: nothing else for w0 yet
    sched.finished("probe", "w0", now_ms() + 1)
    assert stage(sched.breakers, "w0") == "closed"
    await asyncio.sleep(0)  # the states are written in the background
    written = [(o.key, o.record["state"], o.record["failures"]) for o in sender.sent
               if o.event_type == "BreakerState"]
    assert written == [("w0", "closed", 1), ("w0", "closed", 2), ("w0", "open", 3),
                       ("w0", "half_open", 3), ("w0", "closed", 0)]
    assert {o.topic for o in sender.sent if o.event_type == "BreakerState"} == {
        "sched.breakers"}


def test_a_probe_whose_end_is_never_heard_does_not_cut_the_worker_off_for_good() -> None:
    clock = Clock()
    b = Breakers(failures=3, cooldown_s=10, clock=clock)
    failing(b, "w0", 3)
    clock.ms += 10_000
    b.sent("w0", "cpu", "lost-probe")  # its final chunk never reaches this scheduler
    assert not b.allows("w0")
    clock.ms += 10_000
    assert b.allows("w0")  # one more probe, a cool-down later
    b.sent("w0", "cpu", "probe2")
    assert not b.allows("w0")
    assert b.ended("w0", "cpu", "probe2", None) is not None and stage(b, "w0") == "closed"


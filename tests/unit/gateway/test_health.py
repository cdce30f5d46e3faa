"""/healthz's view of the background tasks: ok only while every task is ok."""

from __future__ import annotations

import asyncio

from conveyor.settings import load_settings
from gateway.health import Health
from workers.schedule.breakers import Breakers


def test_starting_until_every_task_has_said_ok() -> None:
    health = Health("gw")
    lease, replies = health.part("reply-lease"), health.part("replies")
    assert health.report()[0] is False
    assert health.report()[1]["status"] == "starting"
    lease.set("ok")
    assert health.report()[1]["status"] == "starting"
    replies.set("ok")
    ok, body = health.report()
    assert ok and body["status"] == "ok" and body["gateway"] == "gw"


def test_degraded_then_ok_again() -> None:
    health = Health("gw")
    part = health.part("reply-lease")
    part.set("ok")
    assert part.set("degraded", "Redis unreachable") is True
    assert part.set("degraded", "Redis unreachable") is False  # no change, no new log line
    ok, body = health.report()
    assert not ok and body["tasks"]["reply-lease"]["detail"] == "Redis unreachable"
    part.set("ok")
    assert health.report()[0]


def test_failed_outranks_degraded() -> None:
    health = Health("gw")
    health.part("a").set("degraded")
    health.part("b").set("failed", "held by gw-other")
    assert health.report()[1]["status"] == "failed"


async def test_a_task_that_ended_is_failed_whatever_it_said() -> None:
    health = Health("gw")
    part = health.part("replies")
    part.set("ok")

    async def dies() -> None:
        raise RuntimeError("gone")

    task = asyncio.create_task(dies(), name="replies")
    health.tasks.append(task)
    await asyncio.gather(task, return_exceptions=True)
    ok, body = health.report()
    assert not ok and body["tasks"]["replies"]["state"] == "failed"
    assert "gone" in body["tasks"]["replies"]["detail"]


def test_the_fleets_open_breakers_are_shown_and_leave_the_gateway_healthy() -> None:
    health = Health("gw-1")
    health.part("replies").set("ok")
    breakers = Breakers.of(load_settings(topic_prefix="h"), clock=lambda: 10_000)
    health.extras["breakers"] = breakers.report
    assert health.report() == (True, {"status": "ok", "gateway": "gw-1", "tasks": {
        "replies": health.parts[0].as_dict()}, "breakers": {}})
    for _ in range(3):
        state = breakers.ended("w1", "cpu", "r", "engine_error", "upstream refused")
        assert state is not None
    ok, body = health.report()
    assert ok and body["breakers"] == {"w1": {
        "state": "open", "failures": 3, "open_for_s": 30.0, "reason": "upstream refused"}}

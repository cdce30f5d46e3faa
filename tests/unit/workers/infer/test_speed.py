"""A worker's measured speed (workers/infer/heartbeat.py): moving averages of its
prefill rate and time per output token, what is too short to measure left out;
they travel in its heartbeat, schedule weighs workers by them, and ``conveyor
workers`` shows them."""

from __future__ import annotations

from typing import Any, cast

import pytest

from cli.workers import render
from conveyor.settings import load_settings
from schemas.codec import default_codec
from tests.support.schedule_tasks import beat
from workers.fleet import describe
from workers.infer.engines.scripted import ScriptedEngine
from workers.infer.heartbeat import ALPHA, Heartbeat, Snapshot, Speed
from workers.outputs import Output, Sender
from workers.prefix import HeldBlocks, PrefixIndex, RoutePolicy, WorkerLoad, choose
from workers.schedule.table import WorkerView, relative_speeds


def test_each_generation_moves_the_averages_and_short_ones_do_not() -> None:
    speed = Speed()
    speed.observe(prefill_tokens=500, first_s=0.5, decode_tokens=100, decode_s=2.0)
    assert speed.prefill_tps == 1000 and speed.tpot_ms == 20
    speed.observe(prefill_tokens=1000, first_s=0.5, decode_tokens=10, decode_s=0.4)
    assert speed.prefill_tps == pytest.approx((1 - ALPHA) * 1000 + ALPHA * 2000)
    assert speed.tpot_ms == pytest.approx((1 - ALPHA) * 20 + ALPHA * 40)
    before = (speed.prefill_tps, speed.tpot_ms)
    speed.observe(prefill_tokens=3, first_s=0.01, decode_tokens=1, decode_s=0.0)  # cached, 1
    assert (speed.prefill_tps, speed.tpot_ms) == before


async def test_the_heartbeat_carries_the_speed() -> None:
    sent: list[Output] = []

    class Delivered:
        async def deliver(self, output: Output) -> None:
            sent.append(output)

    heartbeat = Heartbeat(load_settings(topic_prefix="hb"), cast(Sender, Delivered()), "w0", "cpu",
                          ScriptedEngine(), ["smollm2"], lambda: Snapshot([0], 1), HeldBlocks(),
                          Speed(prefill_tps=850.0, tpot_ms=21.5))
    await heartbeat.beat()
    codec = default_codec()
    decoded: dict[str, Any] = codec.decode(codec.encode("WorkerHeartbeat", sent[0].record),
                                           "WorkerHeartbeat")
    assert (decoded["prefill_tps"], decoded["tpot_ms"]) == (850.0, 21.5)


def measured(worker: str, tpot_ms: float | None) -> WorkerView:
    b = beat(worker, capacity=4)
    b["tpot_ms"] = tpot_ms
    return WorkerView(b)


def test_a_faster_worker_weighs_more_and_gets_the_task_at_equal_load() -> None:
    views = [measured("a", 40.0), measured("b", 20.0), measured("c", 20.0),
             measured("d", None)]
    speeds = relative_speeds(views)
    assert speeds == {"a": 0.5, "b": 1.0, "c": 1.0}  # the median is 20 ms; d unmeasured
    assert relative_speeds([measured("x", 1.0), measured("m", 20.0), measured("y", 200.0)]) \
        == {"x": 4.0, "m": 1.0, "y": 0.25}  # within 1/4..4
    loads = [WorkerLoad("a", 1, 4, speeds["a"]), WorkerLoad("b", 1, 4, speeds["b"])]
    chosen = choose(loads, [], PrefixIndex(), RoutePolicy(), 0)
    assert chosen is not None and chosen.worker_id == "b"  # "a" sorts first, but is slower


def test_conveyor_workers_shows_the_speed() -> None:
    settings = load_settings(topic_prefix="speed")
    row = describe({**beat("a"), "prefill_tps": 812.44, "tpot_ms": 21.06},  # type: ignore[typeddict-item]
                   settings, 0)
    assert (row["prefill_tps"], row["tpot_ms"]) == (812.4, 21.1)
    assert "812 tok/s 21.1 ms/tok" in render([row])
    assert "- -" in render([describe(beat("b"), settings, 0)])

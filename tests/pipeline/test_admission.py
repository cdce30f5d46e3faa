"""Admission against real processes: with its one slot taken, a worker gets no
second task; the request waits in schedule and is refused with 503
``server_overloaded`` and ``Retry-After`` when the schedule timeout passes, or
at once when the pool's queue is full; once the slot is free, requests are
answered again."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.pipeline import Pipeline

TIMEOUT_S = 3


@pytest.fixture(scope="module")
def p(module_pipelines: Callable[..., Pipeline]) -> Pipeline:
    return module_pipelines(workers=1, contexts=1, CONVEYOR_SCHEDULE_TIMEOUT_S=str(TIMEOUT_S),
                            CONVEYOR_SCHEDULE_QUEUE_MAX="1")


def complete(p: Pipeline, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{p.base_url}/v1/completions", timeout=60, json={
        "model": "smollm2", "prompt": "1, 2, 3,", "max_tokens": max_tokens})


def occupied(p: Pipeline, seconds: float) -> threading.Thread:
    """The worker's one slot busy for about ``seconds`` (20 ms a token), streamed
    from a thread; the slot is taken (a first token came) when this returns."""
    streaming = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=60, json={
                "model": "smollm2", "prompt": "1, 2, 3,", "stream": True,
                "max_tokens": int(seconds / 0.02)}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streaming.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert streaming.wait(15), "the long request never started"
    return thread


def test_a_request_with_no_room_in_time_is_a_503_with_retry_after(p: Pipeline) -> None:
    busy = occupied(p, TIMEOUT_S + 5)
    started = time.monotonic()
    r = complete(p, 4)
    waited = time.monotonic() - started
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "server_overloaded"
    assert r.headers["Retry-After"] == "1"
    assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + 3, waited
    busy.join(60)
    assert complete(p, 4).status_code == 200  # the slot is free again


def test_past_the_queue_bound_a_request_is_refused_at_once(p: Pipeline) -> None:
    busy = occupied(p, TIMEOUT_S + 3)
    waiting: list[httpx.Response] = []
    first = threading.Thread(target=lambda: waiting.append(complete(p, 4)))
    first.start()
    time.sleep(0.5)  # it waits in schedule now, the queue's one place taken
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="none", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert time.monotonic() - started < TIMEOUT_S - 1
    assert refused.value.status_code == 503
    assert "too many requests are waiting" in refused.value.message
    first.join(60)
    busy.join(60)
    assert waiting[0].status_code == 503  # it waited out the timeout behind the long one


def test_the_worker_reports_its_measured_speed(p: Pipeline) -> None:
    assert complete(p, 40).status_code == 200
    deadline = time.monotonic() + 10
    while (row := json.loads(p.cli("workers", "--json"))[0])["tpot_ms"] is None:
        assert time.monotonic() < deadline, row
        time.sleep(0.3)
    # the scripted engine writes a token every 20 ms; a loaded machine adds some
    assert 18 <= row["tpot_ms"] <= 80, row

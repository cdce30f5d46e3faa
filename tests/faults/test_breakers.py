"""A worker whose engine keeps failing is cut off: after three engine failures
in a row schedule sends it nothing for the cool-down, then one probe; the
breaker is on conveyor.breakers, so a restarted layers process keeps it open,
and ``conveyor workers`` shows it. One pool: a scripted worker, and an
OpenAI-HTTP worker whose upstream does not exist (every task an engine error).
Its engine fails before the first token, so each of its tasks goes to the
other worker: no client sees the failures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.pipeline import Pipeline
from tests.support.services import free_port

COOL_DOWN_S = 45  # longer than a layers restart takes here (16 s, once 35 s, under load)


@pytest.fixture
def p(services: None, tmp_path: Path) -> Iterator[Pipeline]:
    made = Pipeline(tmp_path, CONVEYOR_BREAKER_COOLDOWN_S=str(COOL_DOWN_S))
    try:
        made.cli("topics")
        made.spawn("layers", "layer")
        made.start_worker("w0", contexts=2)
        # "broken" sorts before "w0": by load alone it would get every other task
        made.spawn("broken", "infer", "--pool", "cpu", "--engine", "openai", "--worker-id",
                   "broken", "--upstream", f"http://127.0.0.1:{free_port()}/v1")
        # healthy, but not asked yet: a readiness request could fail on "broken"
        made.base_url = made.start_gateway("gateway")
        made.wait_workers(2)
        yield made
    finally:
        made.close()


def ask(p: Pipeline) -> tuple[int, str]:
    r = httpx.post(f"{p.base_url}/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    return r.status_code, (r.json().get("error") or {}).get("code") or ""


def breaker(p: Pipeline, worker: str) -> dict[str, object]:
    rows = json.loads(p.cli("workers", "--json"))
    found: dict[str, object] = next(r["breaker"] for r in rows if r["worker_id"] == worker)
    return found


def failures(p: Pipeline) -> int:
    failed: int = breaker(p, "broken").get("failures", 0)  # type: ignore[assignment]
    return failed


def test_three_engine_failures_cut_a_worker_off_until_one_probe(p: Pipeline) -> None:
    # by load, "broken" gets about every other task (and ties, being first by id);
    # each one it fails goes to w0, before any token
    first: list[tuple[int, str]] = []
    while failures(p) < 3:
        first.append(ask(p))
        assert len(first) <= 12, first
    assert set(first) == {(200, "")}, first
    assert [ask(p) for _ in range(6)] == [(200, "")] * 6  # nothing more for it
    assert breaker(p, "broken")["state"] == "open"
    assert breaker(p, "w0")["state"] == "closed"
    deadline = time.monotonic() + 10  # the gateway shows it too, as soon as it reads it
    while "broken" not in (health := httpx.get(f"{p.base_url}/healthz", timeout=10)).json()[
            "breakers"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health.status_code == 200 and health.json()["breakers"]["broken"]["state"] == "open"
    assert "w0" not in health.json()["breakers"]

    # a restarted layers process reads the breaker back from the log (all of
    # this within the cool-down: no request may probe yet)
    opened = time.monotonic()  # at the latest
    p.kill("layers")
    p.respawn("layers")
    p.wait_ready()
    assert [ask(p) for _ in range(4)] == [(200, "")] * 4
    assert time.monotonic() - opened < COOL_DOWN_S, "the restart outlasted the cool-down"
    state = breaker(p, "broken")
    assert state["state"] == "open" and state["failures"] == 3, state

    # after the cool-down, one task probes it (and fails: open again), the rest go on
    time.sleep(float(state["open_for_s"]) + 0.5)  # type: ignore[arg-type]
    after = [ask(p) for _ in range(4)]
    assert after == [(200, "")] * 4, after  # the probe failed, and w0 answered it
    state = breaker(p, "broken")
    assert state["state"] == "open" and state["failures"] == 4, state
    assert state["reason"], state  # the engine's last error


@pytest.fixture
def phantom(services: None, tmp_path: Path) -> Iterator[Pipeline]:
    """``phantom`` (tests/data/models.toml) served by one worker whose upstream
    does not exist; its fallback, SmolLM2, by a scripted one."""
    made = Pipeline(tmp_path)
    try:
        made.cli("topics")
        made.spawn("layers", "layer")
        made.start_worker("w0", contexts=2)
        made.spawn("broken", "infer", "--pool", "phantom", "--engine", "openai",
                   "--worker-id", "broken", "--upstream", f"http://127.0.0.1:{free_port()}/v1")
        made.base_url = made.start_gateway("gateway")
        made.wait_workers(1, pool="phantom")
        made.wait_workers(1)
        yield made
    finally:
        made.close()


def test_an_engine_failing_before_the_first_token_hands_the_request_to_the_fallback(
        phantom: Pipeline) -> None:
    body = {"model": "phantom", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hello."}]}
    r = httpx.post(f"{phantom.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-conveyor-fallback"] == "smollm2-135m-instruct"
    assert r.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{phantom.base_url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-conveyor-fallback"] == "smollm2-135m-instruct"
        frames = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]" and len(frames) > 2
    assert failures(phantom) == 2  # each failure counted against the worker's breaker

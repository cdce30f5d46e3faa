"""A worker whose engine keeps failing is cut off: after three engine failures
in a row schedule sends it nothing for the cool-down, then one probe; the
breaker is on conveyor.breakers, so a restarted layers process keeps it open,
and ``conveyor workers`` shows it. One pool: a scripted worker, and an
OpenAI-HTTP worker whose upstream does not exist (every task an engine error)."""

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


def test_three_engine_failures_cut_a_worker_off_until_one_probe(p: Pipeline) -> None:
    # by load, "broken" gets about every other task (and ties, being first by id)
    first: list[tuple[int, str]] = []
    while first.count((500, "engine_error")) < 3:
        first.append(ask(p))
        assert len(first) <= 12, first
    assert set(first) <= {(500, "engine_error"), (200, "")}, first
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
    assert after.count((500, "engine_error")) == 1 and after.count((200, "")) == 3, after
    state = breaker(p, "broken")
    assert state["state"] == "open" and state["failures"] == 4, state
    assert state["reason"], state  # the engine's last error

"""Infer workers under faults of Redis, of their peers and of the gateway, on the
real broker, a Redis of the test's own, and real processes."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from schemas.codec import default_codec
from schemas.records import DeadLetter
from tests.faults.test_delivery import (
    COUNTING,
    _chunks_of,
    _read_topic,
    _worker_of,
    count,
    sse_events,
)
from tests.support.pipeline import Pipeline
from tests.support.services import OwnRedis, free_port
from workers.infer.progress import progress_of


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline], module_redis: OwnRedis) -> Iterator[Pipeline]:
    """Two workers of one context each on the module's own Redis, for the tests
    that break it (and kill workers); made whole again after each."""
    shared = module_pipelines(workers=2, contexts=1, CONVEYOR_REDIS_URL=module_redis.url)
    try:
        yield shared
    finally:
        shared.heal(redis=module_redis)


def test_redis_wiped_and_the_worker_killed_mid_answer_still_give_one_whole_answer(
        p: Pipeline, module_redis: OwnRedis) -> None:
    """Redis comes back empty (its claims forgotten) and the worker generating the
    answer dies: the survivor must learn from the log, not from Redis, that the
    task is a retry, and continue the answer instead of starting a second one."""
    killed: list[str] = []

    def break_things(rid: str) -> None:
        killed.append(_worker_of(p, rid))
        module_redis.wipe()
        module_redis.start()
        p.kill(killed[0])

    answer = count(p, 300, break_things)
    assert killed and answer.dones == 1 and answer.finishes == 1
    assert answer.counted_on(), answer.text
    assert len(answer.numbers()) > 40
    chunks = _chunks_of(p, answer.request_id)
    assert killed[0] in {c["worker_id"] for c in chunks}
    assert len({c["worker_id"] for c in chunks}) == 2, "the survivor did not continue it"
    assert progress_of(chunks).finished


def test_a_worker_killed_while_redis_is_down_is_continued_from_the_log(
        p: Pipeline, module_redis: OwnRedis) -> None:
    """No Redis to ask whether the task is a retry, nor to lease it: the survivor
    decides from the log and continues the answer."""
    killed: list[str] = []

    def break_things(rid: str) -> None:
        killed.append(_worker_of(p, rid))
        module_redis.stop()
        p.kill(killed[0])
        back.start()

    back = threading.Timer(4.0, module_redis.start)
    answer = count(p, 300, break_things)
    if back.ident is not None:  # started by break_things
        back.join()
    assert killed and answer.dones == 1 and answer.finishes == 1
    assert answer.counted_on(), answer.text
    chunks = _chunks_of(p, answer.request_id)
    assert len({c["worker_id"] for c in chunks}) == 2, "the survivor did not continue it"


def test_a_redis_outage_does_not_stop_a_busy_worker(
        p: Pipeline, module_redis: OwnRedis) -> None:
    def blip(rid: str) -> None:
        module_redis.stop()
        time.sleep(3)
        module_redis.start()

    answer = count(p, 300, blip)
    assert answer.dones == 1 and answer.counted_on(), answer.text
    assert all(p.procs[w].poll() is None for w in p.workers), p.tail("w0") + p.tail("w1")
    # and it still serves after the outage
    again = count(p, 20)
    assert again.dones == 1 and again.counted_on()


def test_a_cancelled_queued_task_is_never_generated(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    """The only worker is busy; a second request waits in its partition, and its
    client leaves. When the worker gets to it, it must not generate it."""
    p = pipeline_factory(workers=1, contexts=1)
    ids: list[str] = []
    busy = threading.Event()

    def long_answer() -> None:
        with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                          json={**COUNTING, "max_tokens": 250}) as r:
            for event in sse_events(r):
                if isinstance(event, dict) and not busy.is_set():
                    ids.append(event["id"].removeprefix("cmpl-"))
                    busy.set()

    first = threading.Thread(target=long_answer)
    first.start()
    assert busy.wait(60)
    # a non-streamed request whose client gives up while its task is queued
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{p.base_url}/v1/completions", timeout=2.5,
                   json={**COUNTING, "stream": False, "max_tokens": 200, "user": "queued"})
    first.join(120)
    # the queued request's task reaches the worker after the long answer ends
    time.sleep(3)
    answer = count(p, 5)  # the worker is free and serving again
    assert answer.dones == 1
    queued = _request_ids(p) - {ids[0], answer.request_id}
    assert queued
    # the queued request (and the readiness probe) wrote no token: never generated
    for rid in queued:
        produced = sum(c["tokens"] for c in _chunks_of(p, rid))
        assert produced == 0, f"the cancelled request {rid} was generated ({produced} tokens)"


def _request_ids(p: Pipeline) -> set[str]:
    """The requests that entered since the readiness probe."""
    codec = default_codec()
    values = asyncio.run(_read_topic(p.settings.kafka.bootstrap, p.settings.kafka.topic("requests"),
                                     10))
    requests = [codec.decode(v, "Request") for v in values]
    return {r["envelope"]["request_id"] for r in requests if r["generation"]["prompt"] != "Hi"}


def test_the_generations_of_a_dead_gateway_are_cancelled(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    """Nobody can receive the answer once its gateway died: the worker stops it when
    the gateway's reply lease has lapsed, instead of generating it to the end."""
    p = pipeline_factory(workers=1, contexts=1, CONVEYOR_REPLY_LEASE_TTL_S="3")
    rid: list[str] = []
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=60,
                      json={**COUNTING, "max_tokens": 1500}) as r:
        for event in sse_events(r):
            if isinstance(event, dict):
                rid.append(event["id"].removeprefix("cmpl-"))
                break
        p.kill("gateway")
    deadline = time.monotonic() + 40
    progress = progress_of([])
    while time.monotonic() < deadline and not progress.finished:
        time.sleep(1)
        progress = progress_of(_chunks_of(p, rid[0]))
    assert progress.finished, "the generation went on for nobody"
    assert progress.tokens < 1500


def test_an_engine_failure_is_answered_and_kept_in_the_dead_letter_topic(
        services: None, tmp_path: Path) -> None:
    """An upstream engine that cannot be reached: the client gets 500 engine_error
    and the task is kept in conveyor.dlq with the error, as docs/api/index.md promises."""
    p = Pipeline(tmp_path)
    try:
        _check_engine_failure(p, _start_with_dead_upstream(p))
    finally:
        p.close()


def _start_with_dead_upstream(p: Pipeline) -> int:
    """Start it; the worker's metrics port."""
    subprocess.run([sys.executable, "-m", "cli", "topics"], env=p.env, check=True,
                   capture_output=True)
    p.spawn("layers", "layer")
    metrics_port = free_port()
    p.spawn("up", "--metrics-port", str(metrics_port), "infer", "--pool", "cpu",
            "--engine", "openai", "--worker-id", "up",
            "--upstream", f"http://127.0.0.1:{free_port()}/v1")
    p.spawn("gateway", "gateway")
    p.wait_workers(1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{p.base_url}/healthz", timeout=1).status_code == 200:
                return metrics_port
        time.sleep(0.5)
    raise RuntimeError("the gateway did not become healthy")


def _check_engine_failure(p: Pipeline, metrics_port: int) -> None:
    r = httpx.post(f"{p.base_url}/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
    codec = default_codec()
    letters: list[DeadLetter] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not letters:
        values = asyncio.run(_read_topic(p.settings.kafka.bootstrap,
                                         p.settings.kafka.topic("dlq"), 10))
        letters = [d for d in (codec.decode(v, "DeadLetter") for v in values)
                   if d["layer"] == "infer"]
    assert letters, "the engine failure was not kept in the dead-letter topic"
    assert "EngineError" in letters[0]["error"] and letters[0]["value"]
    # and the worker counted it, as a layer counts its dead letters
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    counted = [line for line in text.splitlines()
               if line.startswith("conveyor_layer_dead_letters_total{")
               and 'conveyor_layer="infer"' in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) == 1.0, counted

"""Prefix-aware routing through the whole pipeline: the turns of a conversation
go to the worker that served its history (its KV cache holds the prompt's
beginning), and a hot prefix spills over to the other worker only past the
load bound (two workers of two slots each)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from schemas.codec import default_codec
from tests.support.pipeline import Pipeline
from tests.support.topics import records
from topics.catalog import TOKENS

# about 250 tokens: three whole blocks of 64 the turns share
SYSTEM = "You are a guide to lighthouses. " + " ".join(
    f"Rule {i}: keep point {i} short and name a source for it." for i in range(1, 20))


def chat(p: Pipeline, messages: list[dict[str, str]], max_tokens: int = 4) -> dict[str, Any]:
    r = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def workers_of(p: Pipeline, answers: list[dict[str, Any]]) -> list[str]:
    """The worker that generated each answer, from its chunks on conveyor.tokens."""
    codec = default_codec()
    ids = [a["id"].removeprefix("chatcmpl-") for a in answers]
    found: dict[str, str] = {}
    for record in asyncio.run(records(p, [p.settings.kafka.topic("tokens")])):
        for chunk in TOKENS.unpack(codec, record.value):
            found.setdefault(chunk["envelope"]["request_id"], chunk["worker_id"])
    return [found[i] for i in ids]


def first_turn_beside_a_long_answer(p: Pipeline, system: str) -> tuple[
        list[dict[str, str]], dict[str, Any], dict[str, Any]]:
    """A conversation's first turn, asked while another conversation keeps one
    worker busy (so the turn goes to the other one); the history for the next
    turn, the answer, and the busy worker's answer (its id)."""
    started, done = threading.Event(), threading.Event()
    busy: dict[str, Any] = {}

    def long_answer() -> None:
        with httpx.stream("POST", f"{p.base_url}/v1/chat/completions", timeout=60,
                          json={"model": "smollm2", "stream": True, "max_tokens": 150,
                                "messages": [{"role": "user", "content": "Count on."}]}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    busy.setdefault("id", json.loads(line.removeprefix("data: "))["id"])
                    started.set()
        done.set()

    thread = threading.Thread(target=long_answer)
    thread.start()
    assert started.wait(30)
    history = [{"role": "system", "content": system},
               {"role": "user", "content": "Which is the oldest?"}]
    first = chat(p, history)
    thread.join(60)
    assert done.is_set()
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And the tallest?"}]
    return history, first, busy


def test_the_next_turn_goes_where_the_history_is_not_to_the_least_loaded(
        pipeline: Pipeline) -> None:
    history, first, _ = first_turn_beside_a_long_answer(pipeline, SYSTEM)
    # both workers are idle now: by load alone the lower worker id would take it
    second = chat(pipeline, history)
    one, two = workers_of(pipeline, [first, second])
    assert two == one, "the second turn left the worker holding the history"


def test_schedule_knows_where_the_history_is_after_a_restart(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    """The layers process SIGKILLed between two turns: the new scheduler sent
    nothing, and learns from the workers' heartbeats (the blocks their caches
    hold) where the history is."""
    p = pipeline_factory(workers=2, contexts=2)
    history, first, busy = first_turn_beside_a_long_answer(
        p, SYSTEM.replace("lighthouses", "canals"))
    threading.Event().wait(1.5)  # a heartbeat carries the turn's blocks
    p.kill("layers")
    p.respawn("layers")
    p.wait_ready()
    second = chat(p, history)
    # which worker the long answer went to is the load's choice (a worker whose
    # first heartbeat is late may be passed over): the turn goes to the other
    taken, one, two = workers_of(p, [busy, first, second])
    assert one != taken, "the first turn was to go beside the busy worker"
    assert two == one, "the restarted scheduler sent the turn away from its history"


def _until_idle(p: Pipeline, since_ms: int, within: float = 30.0) -> None:
    """Until every worker's heartbeat, sent after ``since_ms``, says it runs and
    queues nothing, and a second more for schedule to count the same (what the
    suite ran before, and the warm-up answer, are over)."""
    codec = default_codec()
    deadline = time.monotonic() + within
    while True:
        latest: dict[str, Any] = {}
        for record in asyncio.run(records(p, [p.settings.kafka.topic("workers")])):
            beat = codec.decode(record.value, "WorkerHeartbeat")
            if beat["ts_ms"] > since_ms:
                latest[beat["worker_id"]] = beat
        if len(latest) == len(p.workers) and all(
                b["running"] == 0 and b["queued"] == 0 for b in latest.values()):
            time.sleep(1.0)
            return
        assert time.monotonic() < deadline, latest
        time.sleep(0.3)


def _turn(p: Pipeline, messages: list[dict[str, str]], started: threading.Event,
          answer: dict[str, Any]) -> None:
    """A streamed turn: ``answer["id"]`` and ``started`` set at its first chunk
    (it was placed on a worker), the rest read to the end."""
    with httpx.stream("POST", f"{p.base_url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": messages, "max_tokens": 100, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not started.is_set():
                answer["id"] = json.loads(line[len("data: "):])["id"]
                started.set()


def test_a_hot_prefix_spills_over_only_past_the_load_bound(pipeline: Pipeline) -> None:
    """Three turns sharing a prefix at once: the holder takes two (its mean-load
    bound with the third counted), the other worker the third. Each turn is sent
    once the one before it streams, so they are placed in order however slow the
    machine is."""
    base = [{"role": "system", "content": SYSTEM.replace("lighthouses", "harbours")}]
    warm = chat(pipeline, [*base, {"role": "user", "content": "Hello."}])
    _until_idle(pipeline, int(time.time() * 1000))
    answers: list[dict[str, Any]] = [{}, {}, {}]
    threads = []
    for i in range(3):
        started = threading.Event()
        threads.append(threading.Thread(target=_turn, args=(
            pipeline, [*base, {"role": "user", "content": f"Question {i}?"}], started,
            answers[i])))
        threads[-1].start()
        assert started.wait(60), f"turn {i} did not start"
    for thread in threads:
        thread.join(60)
    holder, *placed = workers_of(pipeline, [warm, *answers])
    assert placed[:2] == [holder, holder] and placed[2] != holder, (holder, placed)

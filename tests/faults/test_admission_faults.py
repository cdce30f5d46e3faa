"""Admission keeps the promise under a SIGKILL: a request waiting in schedule
for a worker with room is held by its uncommitted offset, so when the layers
process dies, the one started after it reads the task again and places it once
a slot frees; the client gets one whole answer, generated once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import httpx
import pytest

from schemas.codec import default_codec
from tests.support.pipeline import Pipeline
from tests.support.topics import records
from topics.catalog import TOKENS


@pytest.fixture(scope="module")
def p(module_pipelines: Callable[..., Pipeline]) -> Pipeline:
    return module_pipelines(workers=1, contexts=1, CONVEYOR_SCHEDULE_TIMEOUT_S="60")


def test_a_waiting_request_outlives_a_killed_scheduler_and_is_answered_once(
        p: Pipeline) -> None:
    streaming = threading.Event()
    long_answer: list[str] = []

    def occupy() -> None:  # the worker's one slot, for about 4 s
        with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=90, json={
                "model": "smollm2", "prompt": "1, 2, 3,", "stream": True,
                "max_tokens": 200}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streaming.set()
                    long_answer.append(line)

    busy = threading.Thread(target=occupy)
    busy.start()
    assert streaming.wait(15)
    waiting: list[httpx.Response] = []
    second = threading.Thread(target=lambda: waiting.append(httpx.post(
        f"{p.base_url}/v1/completions", timeout=90,
        json={"model": "smollm2", "prompt": "7, 8,", "max_tokens": 5})))
    second.start()
    second.join(1.0)  # it waits in schedule now: the slot is taken
    assert not waiting
    p.kill("layers")
    p.respawn("layers")
    second.join(90)
    busy.join(90)
    assert waiting and waiting[0].status_code == 200, waiting
    answer = waiting[0].json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5
    # generated once: one run of it on the tokens topic, one final chunk
    codec = default_codec()
    rid = waiting[0].headers["x-request-id"]
    chunks = [c for r in asyncio.run(records(p, [p.settings.kafka.topic("tokens")]))
              for c in TOKENS.unpack(codec, r.value) if c["envelope"]["request_id"] == rid]
    assert len({c["run_id"] for c in chunks}) == 1, chunks
    assert sum(c["finish_reason"] is not None for c in chunks) == 1
    assert long_answer  # the stream that held the slot went on to its end

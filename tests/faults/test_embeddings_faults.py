"""An embedding worker SIGKILLed in the middle of a request's batch: the other
worker of the pool embeds it again from the task the dead one never committed,
and the client gets one answer, counted once."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
import redis

from schemas.records import UsageRecord
from tests.support.pipeline import Pipeline
from topics.catalog import USAGE
from topics.envelope import now_ms
from topics.lookup import SharedLookup

MODEL = "all-minilm-l6-v2"


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline]) -> Iterator[Pipeline]:
    made = module_pipelines(workers=1, contexts=2)
    for name in ("embed-0", "embed-1"):
        if name not in made.procs or made.procs[name].poll() is not None:
            made.spawn(name, "infer", "--engine", "encoder", "--pool", "embed",
                       "--contexts", "8", "--worker-id", name)
    made.wait_workers(2, pool="embed")
    try:
        yield made
    finally:
        made.heal()


def busy_worker(p: Pipeline, within_s: float = 60.0) -> str:
    """The worker holding the one embedding task's lease."""
    client = redis.Redis.from_url(p.settings.redis.url)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for key in client.scan_iter(f"{p.prefix}:lease:*", count=1000):
            holder = client.get(key)
            if holder and holder.decode().startswith("embed-"):
                return str(holder.decode())
        time.sleep(0.05)
    raise AssertionError("no embedding worker took the task")


def test_a_worker_killed_mid_batch_leaves_the_request_to_the_other_answered_once(
        p: Pipeline) -> None:
    texts = [f"sentence {i} " + "of a long text about a pipeline of events " * 20
             for i in range(160)]
    since = now_ms()
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{p.base_url}/v1/embeddings", timeout=180,
        json={"model": MODEL, "input": texts, "encoding_format": "base64"})))
    sender.start()
    killed = busy_worker(p)
    time.sleep(0.5)  # into the batch
    p.kill(killed)
    sender.join(timeout=180)
    [r] = answer
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(160))
    vectors = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    journey = json.loads(p.cli("inspect", r.headers["x-request-id"], "--json"))
    assert journey["worker_id"] not in ("", killed), journey["worker_id"]
    records = asyncio.run(usage_of(p, r.headers["x-request-id"], since))
    assert [(u["status"], u["prompt_tokens"]) for u in records] == [
        ("completed", r.json()["usage"]["prompt_tokens"])]


async def usage_of(p: Pipeline, rid: str, since_ms: int) -> list[UsageRecord]:
    lookup = SharedLookup(p.settings)
    try:
        await asyncio.sleep(2.0)  # a second record, were one written, would be there by now
        return [u for _, u in await lookup.find(USAGE, None, since_ms)
                if u["request_id"] == rid]
    finally:
        await lookup.close()

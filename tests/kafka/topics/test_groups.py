"""The consumer groups of a deployment read from the real broker while a real
layer (preprocess, on its runtime) consumes: its group Stable with its member
while it runs, the lag falling to 0 once it has consumed, Empty with the lag
of what came after it stopped; and a broker that does not answer is a
KafkaConnectionError, never a hang, leaving no client open."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from gateway.errors import BACKEND_ERRORS
from schemas.codec import default_codec
from tests.support.factories import request
from tests.support.pipeline import TEST_MODELS
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import KafkaConnectionError
from topics.groups import GroupReader, GroupState, describe_groups
from workers.runtime import LayerRuntime
from workers.stages import stage


async def fresh_settings() -> Settings:
    """Settings of a topic prefix of their own, its topics made."""
    s = load_settings(topic_prefix=f"gr{uuid.uuid4().hex[:10]}", models_file=TEST_MODELS)
    await ensure_topics(s, catalog(s.kafka))
    return s


@pytest.fixture
async def settings(services: None) -> Settings:
    return await fresh_settings()


async def send(settings: Settings, n: int) -> None:
    """``n`` requests for the ``ghost`` model (its tokenizer is an estimate)."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await producer.start()
    try:
        for _ in range(n):
            rid = uuid.uuid4().hex
            await producer.send_and_wait(
                settings.kafka.topic("requests"),
                default_codec().encode("Request", request(request_id=rid, model="ghost")),
                key=rid.encode())
    finally:
        await producer.stop()


@contextlib.asynccontextmanager
async def running(settings: Settings, name: str = "preprocess") -> AsyncIterator[LayerRuntime]:
    """The layer ``name`` consuming on its runtime, as ``conveyor layer`` runs it."""
    runtime = LayerRuntime(settings, stage(name).make(settings, Registry.load(TEST_MODELS)))
    task = asyncio.create_task(runtime.run())
    try:
        await asyncio.wait_for(runtime.ready.wait(), 60)
        yield runtime
    finally:
        runtime.stop()
        await asyncio.wait_for(task, 60)


async def group_until(settings: Settings, layer: str, done: Callable[[GroupState], bool],
                      within: float = 30.0) -> GroupState:
    seen: Any = None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        seen = next((g for g in await describe_groups(settings) if g.layer == layer), None)
        if seen is not None and done(seen):
            return seen
        await asyncio.sleep(0.3)
    raise AssertionError(f"gave up on {layer}'s group: {seen}")


async def test_a_running_layers_group_is_stable_and_catches_up(settings: Settings) -> None:
    await send(settings, 6)
    assert [g.layer for g in await describe_groups(settings)] == []  # nothing consumed yet

    async with running(settings):
        group = await group_until(settings, "preprocess",
                                  lambda g: g.state == "Stable" and g.members != []
                                  and sum(p.committed or 0 for p in g.partitions) == 6)
        assert group.group == settings.kafka.group("preprocess") and group.lag == 0
        [member] = group.members
        assert member.startswith(f"preprocess-{os.getpid()}@")  # its layer and its process
        partitions = settings.kafka.pipeline_partitions
        assert [(p.topic, p.partition) for p in group.partitions] == [
            (settings.kafka.topic("requests"), i) for i in range(partitions)]
        assert all(p.member == member and p.lag == 0 for p in group.partitions)
        assert sum(p.end for p in group.partitions) == 6

    await send(settings, 3)  # while nobody consumes
    group = await group_until(settings, "preprocess",
                              lambda g: g.state == "Empty" and g.lag == 3)
    assert group.members == [] and all(p.member is None for p in group.partitions)
    # a partition with no commit counts from its start
    assert all(p.lag == p.end - (p.committed or 0) for p in group.partitions)

    async with running(settings):
        await group_until(settings, "preprocess", lambda g: g.state == "Stable" and g.lag == 0
                          and sum(p.committed or 0 for p in g.partitions) == 9)


async def test_groups_come_in_pipeline_order_answering_fast(settings: Settings) -> None:
    await send(settings, 2)
    async with running(settings, "route"), running(settings, "preprocess"):
        groups = await group_until(settings, "route", lambda g: g.state == "Stable")
        await group_until(settings, "preprocess", lambda g: g.state == "Stable")
        layers = [g.layer for g in await describe_groups(settings)]
        assert layers == ["preprocess", "route"], groups
        kept = GroupReader(settings)  # as the console keeps one: it starts at its first read
        try:
            assert [g.layer for g in await kept.describe()] == layers
            started = time.monotonic()
            for _ in range(5):
                await kept.describe()
            assert (time.monotonic() - started) / 5 < 0.3
        finally:
            await kept.close()
        started = time.monotonic()
        await describe_groups(settings)
        assert time.monotonic() - started < 0.3


async def test_a_close_beside_a_read_that_starts_afresh_leaves_nothing_open(
        settings: Settings) -> None:
    """The console's shutdown closes its reader while a request's read starts
    the clients again: each pair of clients is closed, none left running."""
    await send(settings, 1)
    before = asyncio.all_tasks()
    kept = GroupReader(settings)
    await kept.describe()
    await asyncio.gather(kept.close(), kept.describe())
    await kept.close()
    await asyncio.sleep(0.1)
    assert {t for t in asyncio.all_tasks() - before if not t.done()} == set()


async def test_kafka_down_is_a_connection_error_never_a_hang(settings: Settings) -> None:
    assert issubclass(KafkaConnectionError, BACKEND_ERRORS)  # the console says so
    before = asyncio.all_tasks()
    refused = settings.replace(kafka_bootstrap=f"127.0.0.1:{closed_port()}")
    with pytest.raises(KafkaConnectionError):
        await describe_groups(refused)
    kept = GroupReader(refused, timeout_s=1.0)
    for _ in range(2):  # a read that failed leaves nothing open; the next starts afresh
        with pytest.raises(KafkaConnectionError):
            await kept.describe()
    await kept.close()
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = settings.replace(kafka_bootstrap=f"127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(KafkaConnectionError, match="did not answer within 1 s"):
            async with GroupReader(mute, timeout_s=1.0) as reader:
                await reader.describe()
        assert time.monotonic() - started < 5
    await asyncio.sleep(0.1)
    assert {t for t in asyncio.all_tasks() - before if not t.done()} == set()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

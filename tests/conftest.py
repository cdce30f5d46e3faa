"""Shared fixtures: the real Kafka and Redis that infra/ starts, Conveyors of
real processes (tests/support/pipeline.py), and services of a test's own to
break. Each tier's directory gives its tests their marker (``unit``, ``engines``,
``kafka``, ``pipeline``, ``faults``, ``vllm``): ``bash infra/test.sh --fast`` runs
``tests/unit`` alone, with no service running and no model loaded; ``tests/engines``
runs the real llama.cpp engines on the packaged model, with no service either.
``tests/vllm`` runs in the environment that ``bash infra/vllm.sh`` builds
(``.venv-vllm``); a Python without vLLM leaves it out."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient

import topics.admin
from conveyor.settings import Settings
from tests.support.pipeline import LLAMACPP, Pipeline, answers
from tests.support.services import OwnKafka, OwnRedis
from workers.infer.engines.base import Engine

E = TypeVar("E", bound=Engine)

TIERS = ("unit", "engines", "kafka", "pipeline", "faults", "vllm")
# vLLM is not in .venv (infra/vllm.sh): its tier runs from .venv-vllm (infra/test.sh)
collect_ignore = ["vllm"] if importlib.util.find_spec("vllm") is None else []


# the topic prefixes this test process created topics under, on the shared broker
_created: set[str] = set()
_ensure_topics = topics.admin.ensure_topics


async def _recording_ensure_topics(settings: Settings, *args: Any, **kwargs: Any) -> Any:
    """``topics.admin.ensure_topics``, its prefix kept to drop at the session's end."""
    if settings.kafka.bootstrap == os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"):
        _created.add(settings.kafka.topic_prefix)
    return await _ensure_topics(settings, *args, **kwargs)


# bound before the test modules import it (a module's own broker is not recorded)
topics.admin.ensure_topics = _recording_ensure_topics  # type: ignore[assignment]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Drop the topics this process's tests created on the shared broker: a run
    left about 1,200 partitions behind, and a broker that kept them ran out of
    file descriptors after some twenty runs. Each test process drops only its
    own prefixes (the others may still be running), never ``conveyor``."""
    prefixes = tuple(f"{p}{sep}" for p in _created - {"conveyor"} for sep in ".-")
    if not prefixes:
        return

    async def drop() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=os.environ.get(
            "CONVEYOR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"), request_timeout_ms=20_000)
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(prefixes)]
            for at in range(0, len(names), 500):
                await admin.delete_topics(names[at:at + 500], timeout_ms=20_000)
        finally:
            await admin.close()

    try:
        asyncio.run(asyncio.wait_for(drop(), 60))
    except Exception as exc:  # the topics stay: a later run is no worse than before
        print(f"\nconftest: the topics of {len(_created)} test prefixes were not dropped: "
              f"{exc!r}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, from the directory it lives in."""
    root = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(root).parts
        if len(parts) < 2 or parts[0] not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in the directory of its "
                                    f"tier, one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(parts[0])


@pytest.fixture(scope="session")
def services() -> None:
    """Kafka and Redis must run (``bash infra/kafka.sh start``, ``bash infra/redis.sh start``)."""
    kafka = os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    host, port = kafka.rsplit(":", 1)
    if not answers(host, int(port)):
        pytest.fail(f"Kafka does not answer on {kafka}: run `bash infra/kafka.sh start`")
    if not answers("127.0.0.1", 6379):
        pytest.fail("Redis does not answer on 127.0.0.1:6379: run `bash infra/redis.sh start`")


@pytest.fixture
def pipeline_factory(services: None, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Callable[..., Pipeline]]:
    """Conveyors of their own, for tests that break things: ``make(workers,
    contexts, **env)`` starts one; all are torn down after the test."""
    made: list[Pipeline] = []

    def make(workers: int = 1, contexts: int = 1, **env: str) -> Pipeline:
        p = Pipeline(tmp_path_factory.mktemp("logs"), **env)
        made.append(p)
        return p.start(workers=workers, contexts=contexts)

    try:
        yield make
    finally:
        for p in made:
            p.close()


@pytest.fixture(scope="module")
def module_pipelines(services: None, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Callable[..., Pipeline]]:
    """``make(workers, contexts, engine=None, **env)``: one Conveyor shared by
    the module's tests that ask for the same settings, started by the first of
    them; each test makes it whole again after itself (``Pipeline.heal``), as a
    module's fixture that hands it out does. Torn down at the module's end: a
    test Conveyor costs some 4.6 s of CPU to start."""
    made: dict[tuple[object, ...], Pipeline] = {}

    def make(workers: int = 1, contexts: int = 1, engine: tuple[str, ...] | None = None,
             **env: str) -> Pipeline:
        key = (workers, contexts, engine, tuple(sorted(env.items())))
        if key not in made:
            made[key] = Pipeline(tmp_path_factory.mktemp("logs"), engine=engine, **env)
            made[key].start(workers=workers, contexts=contexts)
        return made[key]

    try:
        yield make
    finally:
        for p in made.values():
            p.close()


@pytest.fixture
def model_workers(module_pipelines: Callable[..., Pipeline]) -> Iterator[Pipeline]:
    """The module's Conveyor on the real model (llama.cpp, two workers of one
    context each), made whole again after the test."""
    shared = module_pipelines(workers=2, contexts=1, engine=LLAMACPP)
    try:
        yield shared
    finally:
        shared.heal()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    """A redis-server of the test's own (AOF on), free to stop, flush or kill;
    pass ``CONVEYOR_REDIS_URL=own_redis.url`` to the pipeline."""
    server = OwnRedis(tmp_path).start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnRedis]:
    """A redis-server of the module's own, for a module's pipeline whose tests
    stop, flush or wipe it (``Pipeline.heal(redis=...)`` starts it again)."""
    server = OwnRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def breakable_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnKafka]:
    """One Kafka broker for every test that stops and restarts one: a JVM start
    costs 20-40 s on two cores, and each test's pipeline has a topic prefix of
    its own, so the tests share it (``own_kafka`` hands it out running)."""
    broker = OwnKafka(tmp_path_factory.mktemp("breakable-kafka")).start()
    try:
        yield broker
    finally:
        broker.stop(signal.SIGKILL)


@pytest.fixture
def own_kafka(breakable_kafka: OwnKafka) -> Iterator[OwnKafka]:
    """A Kafka broker free to stop and restart (not the shared one other tests
    use); pass ``CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap`` to the pipeline.
    It is running when the test begins and started again after it."""
    breakable_kafka.start()  # infra/kafka.sh start: at once when it already answers
    try:
        yield breakable_kafka
    finally:
        breakable_kafka.start()


@pytest.fixture(scope="session")
def pipeline(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """One Conveyor for the pipeline tests that leave it intact: two CPU workers."""
    p = Pipeline(tmp_path_factory.mktemp("logs"))
    try:
        p.start(workers=2)
        yield p
    finally:
        p.close()


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    """A client of the suite's real Redis (infra/redis.sh)."""
    client = aioredis.from_url("redis://127.0.0.1:6379/0")
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def started_engines() -> AsyncIterator[Callable[[Any], Awaitable[Any]]]:
    """``await start(engine)``: the engine started, and closed after the test."""
    engines: list[Engine] = []

    async def start(engine: E) -> E:
        await engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.close()

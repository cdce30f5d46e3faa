"""Services of a test's own, to break on purpose: a redis-server and a
single-node Kafka on free loopback ports, which a fault test may stop, restart,
flush or SIGKILL without touching the shared ones other tests use
(``own_redis``, ``own_kafka`` and ``breakable_kafka`` in tests/conftest.py
hand them out). They are infra/services.py's, beside the scripts that run
them, where the chaos benchmark finds them too."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from conveyor.settings import Settings
from infra.services import OwnKafka, OwnRedis, free_port

__all__ = ["OwnRedis", "OwnKafka", "free_port", "prefix_redis"]


@contextlib.asynccontextmanager
async def prefix_redis(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    """A client of the shared Redis, and every key of ``settings``' prefix
    deleted after it."""
    client = aioredis.from_url(settings.redis.url)
    try:
        yield client
    finally:
        pattern = f"{settings.kafka.topic_prefix}:*"
        keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()

"""What the key and tenant store tests share: a Conveyor prefix of their own on
the real Kafka and a Redis (the shared one, or a test's own), with as many
store replicas as a test wants, each with a Redis client of its own as
separate gateways have. The prefix's Redis keys are removed afterwards."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr

from conveyor.settings import Settings, load_settings
from gateway.audit import Audit
from gateway.auth.keys import KeyStore
from gateway.auth.tenants import TenantStore
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from topics.follow import follow

__all__ = ["Backends", "backends", "key_settings", "read_topic", "wait_until"]

SHARED_REDIS = "redis://127.0.0.1:6379/0"


def key_settings(redis_url: str = SHARED_REDIS, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "topic_prefix": f"ks{uuid.uuid4().hex[:10]}", "redis_url": redis_url,
        "auth_secret": SecretStr("server-secret-of-the-key-tests"),
        "retry_backoff_max_s": 0.2, **overrides}
    return load_settings(**values)


async def wait_until(predicate: Any, within: float, what: str) -> float:
    """Poll ``predicate`` (sync or async) until true; the seconds it took."""
    start = time.monotonic()
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"{what}: not within {within} s"
        await asyncio.sleep(0.01)


@dataclass
class Backends:
    settings: Settings
    producer: AIOKafkaProducer
    audit: Audit
    clients: list[aioredis.Redis] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def redis(self) -> aioredis.Redis:
        client = aioredis.from_url(self.settings.redis.url, socket_timeout=1,
                                   socket_connect_timeout=1)
        self.clients.append(client)
        return client

    def keys(self, **options: Any) -> KeyStore:
        """A key store with a producer and audit (what the CLI builds)."""
        return KeyStore(self.settings, self.redis(), self.producer, audit=self.audit, **options)

    def gateway_keys(self, subscribe: bool = True, **options: Any) -> KeyStore:
        """A key store as a gateway builds it: no producer; its invalidations run."""
        store = KeyStore(self.settings, self.redis(), **options)
        if subscribe:
            self.tasks.append(asyncio.create_task(store.invalidations.run()))
        return store

    def tenants(self, subscribe: bool = False) -> TenantStore:
        store = TenantStore(self.settings, self.redis(), self.producer, audit=self.audit)
        if subscribe:
            self.tasks.append(asyncio.create_task(store.invalidations.run()))
        return store


@asynccontextmanager
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    wanted = {settings.kafka.topic("keys"), settings.kafka.topic("audit")}
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name in wanted])
    producer = make_producer(settings.kafka)
    await producer.start()
    b = Backends(settings, producer, Audit(settings, producer, actor="test"))
    try:
        yield b
    finally:
        for task in b.tasks:
            task.cancel()
        await asyncio.gather(*b.tasks, return_exceptions=True)
        await producer.stop()
        cleaner = aioredis.from_url(settings.redis.url, socket_timeout=1,
                                    socket_connect_timeout=1)
        try:
            pattern = f"{settings.kafka.topic_prefix}:*"
            async for key in cleaner.scan_iter(match=pattern, count=1000):
                await cleaner.delete(key)
        except Exception:  # an own Redis the test stopped: nothing to clean
            pass
        finally:
            await cleaner.aclose()
        for client in b.clients:
            await client.aclose()


async def read_topic(settings: Settings, name: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of partition 0 of a topic, as raw bytes."""
    follower = follow(settings, settings.kafka.topic(name), 0, "beginning")
    out: list[tuple[bytes, bytes]] = []

    async def read() -> None:
        async for records in follower:
            out.extend((m.key or b"", m.value or b"") for m in records)

    reading = asyncio.create_task(read())
    try:
        await asyncio.wait_for(follower.caught_up.wait(), 30)
    finally:
        reading.cancel()
    return out

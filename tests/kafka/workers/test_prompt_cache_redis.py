"""PromptCache on the suite's real Redis, under a topic prefix of the test's own:
entries kept and read back, their TTL, a tenant's bound, the size bound, and a
Redis that does not answer read as a miss."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

import workers.prompt_cache as prompt_cache
from conveyor.settings import Settings, load_settings
from tests.support.services import prefix_redis
from tests.support.slow_link import slow_redis
from workers.prompt_cache import MAX_TEXT_CHARS, Cached, PromptCache

ENTRY = Cached(text="Kafka is a distributed log. «ü»", tokens=9, finish_reason="stop",
               model="smollm2-135m-instruct")


@pytest.fixture
def settings(services: None) -> Settings:
    return load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    """A client of its own, and every key of the test's prefix deleted after it."""
    async with prefix_redis(settings) as client:
        yield client


@pytest.fixture
async def cache(settings: Settings, client: aioredis.Redis) -> AsyncIterator[PromptCache]:
    cache = PromptCache(settings)
    try:
        yield cache
    finally:
        await cache.close()


def digest(n: int) -> str:
    return f"{n:040x}"


async def test_an_entry_is_kept_and_read_back(cache: PromptCache, settings: Settings,
                                              client: aioredis.Redis) -> None:
    key = f"acme:{digest(1)}"
    assert await cache.get(key) is None  # a miss before
    assert await cache.put(key, ENTRY, 600) is True
    assert await cache.get(key) == ENTRY
    # stored where the module says, as the entry's value
    raw = await client.get(f"{settings.kafka.topic_prefix}:cache:{key}")
    assert raw is not None and Cached.parse(raw) == ENTRY
    assert await client.zrange(f"{settings.kafka.topic_prefix}:cache-index:acme", 0, -1) == \
        [f"{settings.kafka.topic_prefix}:cache:{key}".encode()]
    # another tenant's key is another entry
    assert await cache.get(f"globex:{digest(1)}") is None
    # a second write replaces the first
    newer = Cached(text="Kafka is a log.", tokens=5, finish_reason="length", model="m2")
    assert await cache.put(key, newer, 600) is True
    assert await cache.get(key) == newer
    assert await client.zcard(f"{settings.kafka.topic_prefix}:cache-index:acme") == 1


async def test_an_entry_and_its_index_live_the_ttl(cache: PromptCache, settings: Settings,
                                                   client: aioredis.Redis) -> None:
    key = f"acme:{digest(2)}"
    assert await cache.put(key, ENTRY, 120)
    ttl = await client.ttl(f"{settings.kafka.topic_prefix}:cache:{key}")
    assert 110 <= ttl <= 120
    index_ttl = await client.ttl(f"{settings.kafka.topic_prefix}:cache-index:acme")
    assert 110 <= index_ttl <= 121  # its longest-lived entry, and a second


async def test_a_tenants_oldest_entries_beyond_the_bound_are_dropped(
        cache: PromptCache, settings: Settings, client: aioredis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_cache, "MAX_ENTRIES", 3)
    keys = [f"acme:{digest(n)}" for n in range(5)]
    for key in keys:
        assert await cache.put(key, ENTRY, 600)
        await asyncio.sleep(0.002)  # distinct written times
    other = f"globex:{digest(0)}"
    assert await cache.put(other, ENTRY, 600)  # a tenant of its own bound

    assert [await cache.get(key) for key in keys] == [None, None, ENTRY, ENTRY, ENTRY]
    assert await client.exists(*(f"{settings.kafka.topic_prefix}:cache:{k}" for k in keys[:2])) == 0
    index = await client.zrange(f"{settings.kafka.topic_prefix}:cache-index:acme", 0, -1)
    assert index == [f"{settings.kafka.topic_prefix}:cache:{k}".encode() for k in keys[2:]]
    assert await cache.get(other) == ENTRY


async def test_a_tenant_whose_id_holds_a_colon_has_a_bound_of_its_own(
        cache: PromptCache, settings: Settings, client: aioredis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The entries of tenant acme:east are not indexed with those of acme, so
    its newest entry does not evict the entry of acme."""
    monkeypatch.setattr(prompt_cache, "MAX_ENTRIES", 1)
    acme, east = f"acme:{digest(1)}", f"acme:east:{digest(2)}"
    assert await cache.put(acme, ENTRY, 600)
    assert await cache.put(east, ENTRY, 600)
    assert [await cache.get(acme), await cache.get(east)] == [ENTRY, ENTRY]
    prefix = settings.kafka.topic_prefix
    assert await client.zrange(f"{prefix}:cache-index:acme", 0, -1) == \
        [f"{prefix}:cache:{acme}".encode()]
    assert await client.zrange(f"{prefix}:cache-index:acme:east", 0, -1) == \
        [f"{prefix}:cache:{east}".encode()]


async def test_a_write_to_a_redis_that_answers_slowly_gives_up_within_its_bound(
        settings: Settings, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command of a write answered in less than a command's own timeout,
    the write as a whole (its pipeline, the index's expiry, the eviction of
    the oldest entry) still ends within the write's bound, not kept."""
    monkeypatch.setattr(prompt_cache, "MAX_ENTRIES", 1)
    async with slow_redis(settings) as (link, slow):
        cache = PromptCache(slow)
        assert await cache.put(f"acme:{digest(1)}", ENTRY, 600)
        link.delay_s = 0.6
        started = time.monotonic()
        kept = await cache.put(f"acme:{digest(2)}", ENTRY, 600)
        took = time.monotonic() - started
        assert not kept and took < prompt_cache._WRITE_TIMEOUT_S + 0.5, took
        await cache.close()


async def test_an_answer_too_long_or_a_ttl_of_nothing_is_not_kept(
        cache: PromptCache, settings: Settings, client: aioredis.Redis) -> None:
    long = Cached(text="x" * (MAX_TEXT_CHARS + 1), tokens=1, finish_reason="length",
                  model="m")
    assert await cache.put(f"acme:{digest(3)}", long, 600) is False
    assert await cache.get(f"acme:{digest(3)}") is None
    assert await cache.put(f"acme:{digest(4)}", ENTRY, 0) is False
    assert await cache.get(f"acme:{digest(4)}") is None
    prefix = settings.kafka.topic_prefix
    assert [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)] == []
    # the bound itself is kept
    edge = Cached(text="y" * MAX_TEXT_CHARS, tokens=1, finish_reason="length", model="m")
    assert await cache.put(f"acme:{digest(5)}", edge, 600) is True
    assert await cache.get(f"acme:{digest(5)}") == edge


async def test_a_redis_that_does_not_answer_is_a_miss() -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                        redis_url="redis://127.0.0.1:1/0")
    cache = PromptCache(settings)
    try:
        started = time.monotonic()
        assert await cache.get(f"acme:{digest(1)}") is None
        assert await cache.put(f"acme:{digest(1)}", ENTRY, 600) is False
        assert await cache.get(f"acme:{digest(1)}") is None
        assert time.monotonic() - started < 5
    finally:
        await cache.close()


async def test_the_bound_holds_when_a_tenants_entries_have_different_ttls(
        cache: PromptCache, settings: Settings, client: aioredis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's policy may set its own ``cache.ttl_s`` (rules.py: the most specific
    scope wins), but a tenant's entries share one index: a write with a short TTL
    must not stop the index from counting the tenant's longer-lived entries."""
    monkeypatch.setattr(prompt_cache, "MAX_ENTRIES", 3)
    for n in range(3):  # written under the tenant's policy: 600 s
        assert await cache.put(f"acme:{digest(n)}", ENTRY, 600)
    await asyncio.sleep(1.1)
    assert await cache.put(f"acme:{digest(10)}", ENTRY, 1)  # a key whose policy says 1 s
    for n in range(20, 23):
        assert await cache.put(f"acme:{digest(n)}", ENTRY, 600)

    pattern = f"{settings.kafka.topic_prefix}:cache:acme:*"
    live = [k async for k in client.scan_iter(match=pattern, count=1000)]
    assert len(live) <= 3, f"{len(live)} entries live for a tenant bound to 3"


async def test_many_entries_are_read_in_one_round_trip(cache: PromptCache) -> None:
    await cache.put(f"acme:{digest(11)}", ENTRY, 600)
    assert await cache.get_many([f"acme:{digest(12)}", f"acme:{digest(11)}"]) == [None, ENTRY]
    assert await cache.get_many([]) == []
    down = PromptCache(load_settings(topic_prefix="t-down", redis_url="redis://127.0.0.1:1/0"))
    try:
        assert await down.get_many([f"acme:{digest(11)}"]) == [None]
    finally:
        await down.close()

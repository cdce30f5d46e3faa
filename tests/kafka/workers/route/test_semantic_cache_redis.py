"""The semantic prompt cache in the route layer, on the suite's real Redis
under a topic prefix of the test's own: a paraphrase of a prompt whose answer
is whole is answered from the cache (one chunk on conveyor.tokens, as the
exact cache's hit), a different question, another tenant, a sampled request
and a prompt whose first answer has not finished go to a model, and the
bounds and TTL hold."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

import workers.route.semantic_cache as semantic_cache
from conveyor.settings import Settings, load_settings
from tests.support.meaning import cached_route, prepared_for
from tests.support.services import prefix_redis
from tests.support.slow_link import slow_redis
from workers.outputs import Output
from workers.prompt_cache import CACHE_WORKER, Cached, PromptCache
from workers.route.embedder import Embedders
from workers.route.semantic_cache import SemanticCache

QUESTION = "How long should I boil an egg?"
PARAPHRASE = "For how long should I boil an egg?"
DIFFERENT = "How long should I boil pasta?"
ANSWER = Cached(text="About seven minutes for a jammy yolk.", tokens=9, finish_reason="stop",
                model="smollm2-135m-instruct")


@pytest.fixture
def settings(services: None) -> Settings:
    return load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    async with prefix_redis(settings) as client:
        yield client


@pytest.fixture(scope="module")
def embedders() -> Embedders:
    return Embedders()


async def routed(layer: object, rid: str, text: str, **kw: object) -> Output:
    [out] = await layer.handle(prepared_for(rid, text, **kw), None)  # type: ignore[attr-defined]
    return out


async def answered(settings: Settings, out: Output) -> None:
    """What the infer worker does when the answer is whole."""
    prompt = out.record["prompt"]
    assert await PromptCache(settings).put(prompt["cache_key"], ANSWER, prompt["cache_ttl_s"])


async def test_a_paraphrase_is_answered_from_the_cache_and_a_different_question_is_not(
        settings: Settings, client: aioredis.Redis, embedders: Embedders) -> None:
    layer = cached_route(settings, embedders)
    first = await routed(layer, "r1", QUESTION)
    assert first.event_type == "Task"
    key = first.record["prompt"]["cache_key"]
    assert key.startswith("acme:") and first.record["prompt"]["cache_ttl_s"] == 600
    # its answer is not whole yet: the paraphrase goes to a model too
    assert (await routed(layer, "r2", PARAPHRASE)).event_type == "Task"
    await answered(settings, first)

    hit = await routed(layer, "r3", PARAPHRASE)
    assert hit.event_type == "TokenChunk" and hit.topic.endswith(".tokens")
    chunk = hit.record
    assert chunk["envelope"]["request_id"] == "r3" and "route" in chunk["envelope"]["stamps"]
    assert (chunk["text"], chunk["worker_id"], chunk["finish_reason"]) == \
        (ANSWER.text, CACHE_WORKER, "stop")
    assert chunk["header"]["model"] == ANSWER.model and chunk["seq"] == 0

    assert (await routed(layer, "r4", DIFFERENT)).event_type == "Task"
    assert (await routed(layer, "r5", PARAPHRASE, tenant="globex")).event_type == "Task"
    sampled = await routed(layer, "r6", PARAPHRASE, temperature=0.7)
    assert sampled.event_type == "Task" and not sampled.record["prompt"].get("cache_key")
    # the same question again is a hit at any threshold
    strict = cached_route(settings, embedders, similarity=1.0)
    assert (await routed(strict, "r7", QUESTION)).event_type == "TokenChunk"
    assert (await routed(strict, "r8", PARAPHRASE)).event_type == "Task"
    await layer.cache.close()
    await strict.cache.close()


async def test_vectors_live_the_ttl_and_a_group_keeps_its_newest(
        settings: Settings, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(semantic_cache, "MAX_VECTORS", 3)
    cache = SemanticCache(settings)
    rng = np.random.default_rng(1)
    vectors = [v / np.linalg.norm(v) for v in rng.normal(size=(5, 384)).astype(np.float32)]
    for i, vector in enumerate(vectors):
        assert await cache.remember("acme:g1", vector, f"acme:{i:040x}", 100 + i)
    group = f"{settings.kafka.topic_prefix}:meaning:acme:g1"
    held = await client.hgetall(group)
    assert sorted(held) == [f"acme:{i:040x}".encode() for i in (2, 3, 4)]
    assert 95 <= await client.ttl(group) <= 105
    index = f"{settings.kafka.topic_prefix}:meaning-index:acme"
    assert await client.zrange(index, 0, -1) == [group.encode()]
    # no answer kept for any of them: nothing is a hit
    assert await cache.nearest("acme:g1", vectors[4], 0.5) is None
    await PromptCache(settings).put(f"acme:{4:040x}", ANSWER, 100)
    hit = await cache.nearest("acme:g1", vectors[4], 0.99)
    assert hit is not None and hit.similarity == 1.0 and hit.cached == ANSWER
    await cache.close()


async def test_a_tenant_whose_id_holds_a_colon_has_an_index_of_its_own(
        settings: Settings, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups of tenant acme:east are not indexed with those of acme, so
    keeping its newest group does not evict the group of acme."""
    monkeypatch.setattr(semantic_cache, "MAX_GROUPS", 1)
    cache = SemanticCache(settings)
    vector = np.ones(384, np.float32) / np.sqrt(384)
    acme, east = f"acme:{'a' * 40}", f"acme:east:{'b' * 40}"
    assert await cache.remember(acme, vector, f"acme:{1:040x}", 100)
    assert await cache.remember(east, vector, f"acme:east:{2:040x}", 200)
    prefix = settings.kafka.topic_prefix
    assert await client.zrange(f"{prefix}:meaning-index:acme", 0, -1) == \
        [f"{prefix}:meaning:{acme}".encode()]
    assert await client.zrange(f"{prefix}:meaning-index:acme:east", 0, -1) == \
        [f"{prefix}:meaning:{east}".encode()]
    assert await client.exists(f"{prefix}:meaning:{acme}", f"{prefix}:meaning:{east}") == 2
    await cache.close()


async def test_a_write_to_a_redis_that_answers_slowly_gives_up_within_its_bound(
        settings: Settings, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command of a write answered in less than a command's own timeout,
    the write as a whole (its pipeline, the index's expiry, the eviction of
    the oldest group) still ends within the write's bound, not kept."""
    monkeypatch.setattr(semantic_cache, "MAX_GROUPS", 1)
    async with slow_redis(settings) as (link, slow):
        cache = SemanticCache(slow)
        vector = np.ones(384, np.float32) / np.sqrt(384)
        assert await cache.remember(f"acme:{'a' * 40}", vector, f"acme:{1:040x}", 100)
        link.delay_s = 0.6
        started = time.monotonic()
        kept = await cache.remember(f"acme:{'b' * 40}", vector, f"acme:{2:040x}", 100)
        took = time.monotonic() - started
        assert not kept and took < semantic_cache._WRITE_TIMEOUT_S + 0.5, took
        await cache.close()


async def test_the_route_layer_goes_on_within_the_cache_s_bounds_when_redis_never_answers(
        settings: Settings, embedders: Embedders) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = settings.replace(redis_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        layer = cached_route(mute, embedders)
        assert (await routed(layer, "r1", QUESTION)).event_type == "Task"  # loads the encoder
        started = time.monotonic()
        out = await routed(layer, "r2", PARAPHRASE)
        took = time.monotonic() - started
        assert out.event_type == "Task" and out.record["route"]["model"] == \
            "smollm2-135m-instruct"
        bound = semantic_cache._TIMEOUT_S + semantic_cache._WRITE_TIMEOUT_S
        assert took < bound + 0.5, took
        await layer.cache.close()

"""The semantic prompt cache against a Redis of the test's own: flushed, it
forgets (a paraphrase goes to the model, which answers it, and is cached
again); stopped, every lookup and write is a miss within its bound, never an
error, and the request goes on to a model; started again, the cache fills
again. A flush between a request's routing and its answer's write loses the
vector, never the answer: the paraphrase goes to the model once, and its own
answer is a hit after."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from conveyor.settings import load_settings
from infra.services import OwnRedis
from tests.support.meaning import cached_route, prepared_for
from workers.outputs import Output
from workers.prompt_cache import Cached, PromptCache
from workers.route.embedder import Embedders
from workers.route.layer import RouteLayer

QUESTION = "How do I undo the last git commit?"
PARAPHRASE = "How can I undo my last git commit?"
ANSWER = Cached(text="git reset --soft HEAD~1", tokens=8, finish_reason="stop",
                model="smollm2-135m-instruct")


async def routed(layer: object, rid: str, text: str) -> Output:
    [out] = await layer.handle(prepared_for(rid, text), None)  # type: ignore[attr-defined]
    return out


@pytest.fixture
async def cached(own_redis: OwnRedis) -> AsyncIterator[tuple[RouteLayer, PromptCache]]:
    """A route layer whose semantic cache, and the answers' cache, are on the
    test's own Redis."""
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}", redis_url=own_redis.url)
    layer, answers = cached_route(settings, Embedders(), similarity=0.9), PromptCache(settings)
    try:
        yield layer, answers
    finally:
        await layer.cache.close()
        await answers.close()


async def answer(answers: PromptCache, out: Output) -> None:
    """The model's answer to a routed task, kept where its cache key says."""
    prompt = out.record["prompt"]
    assert await answers.put(prompt["cache_key"], ANSWER, prompt["cache_ttl_s"])


async def test_a_flushed_or_stopped_redis_is_a_miss_and_never_an_error(
        own_redis: OwnRedis, cached: tuple[RouteLayer, PromptCache]) -> None:
    layer, answers = cached
    await answer(answers, await routed(layer, "r1", QUESTION))
    assert (await routed(layer, "r2", PARAPHRASE)).event_type == "TokenChunk"

    own_redis.flush()
    again = await routed(layer, "r3", PARAPHRASE)
    assert again.event_type == "Task"  # forgotten: the model answers
    await answer(answers, again)
    assert (await routed(layer, "r4", QUESTION)).event_type == "TokenChunk"

    own_redis.stop()
    started = time.monotonic()
    down = await routed(layer, "r5", PARAPHRASE)
    assert down.event_type == "Task" and down.record["route"]["model"] == \
        "smollm2-135m-instruct"
    assert (await routed(layer, "r6", "Something else entirely?")).event_type == "Task"
    assert time.monotonic() - started < 10

    # what was routed while Redis was down names where its answer goes
    assert down.record["prompt"]["cache_key"] and down.record["prompt"]["cache_ttl_s"]
    own_redis.start()  # its append-only file kept what it held
    assert (await routed(layer, "r7", PARAPHRASE)).event_type == "TokenChunk"


async def test_a_flush_before_the_answer_is_kept_loses_the_vector_not_the_answer(
        own_redis: OwnRedis, cached: tuple[RouteLayer, PromptCache]) -> None:
    layer, answers = cached
    first = await routed(layer, "r1", QUESTION)
    assert first.event_type == "Task"
    own_redis.flush()  # while the model answers r1
    await answer(answers, first)  # its answer is kept, its vector is gone
    assert await answers.get(first.record["prompt"]["cache_key"]) == ANSWER
    again = await routed(layer, "r2", PARAPHRASE)
    assert again.event_type == "Task"  # to the model, once: no vector leads to r1's answer
    await answer(answers, again)
    hit = await routed(layer, "r3", QUESTION)
    assert hit.event_type == "TokenChunk" and hit.record["text"] == ANSWER.text

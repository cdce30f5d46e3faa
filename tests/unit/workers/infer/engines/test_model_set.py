"""Several models on one worker (workers/infer/engines/model_set.py), each
served by a scripted engine of its own: warm ones load at start, the others on
their first request, and the least recently used idle one is evicted to keep
to the budget; a model with a generation running is never evicted."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.errors import EngineError
from conveyor.registry import ModelSpec
from schemas.records import HostCache
from workers.infer.engines.base import GenerationRequest, host_cache_counts
from workers.infer.engines.model_set import ModelSet
from workers.infer.engines.scripted import ScriptedEngine

SPECS = [ModelSpec(name, "cpu", 2048) for name in ("a", "b", "c")]
MIB = 1 << 20


class Counted(ScriptedEngine):
    """A scripted engine that says when it starts and closes."""

    log: list[str] = []

    def __init__(self, model: str, delay_ms: float = 0.0) -> None:
        super().__init__("text", text=f"I am {model}.", token_delay_ms=delay_ms)
        self.model = model

    async def start(self) -> None:
        Counted.log.append(f"start {self.model}")
        await super().start()

    async def close(self) -> None:
        Counted.log.append(f"close {self.model}")
        await super().close()


def request(model: str) -> GenerationRequest:
    return GenerationRequest(request_id=f"r-{model}", kind="chat", model=model, max_tokens=8)


async def answer(models: ModelSet, model: str) -> str:
    return "".join([p.text async for p in models.generate(request(model))])


def made(delay_ms: float = 0.0, **kwargs: object) -> ModelSet:
    Counted.log = []
    return ModelSet(SPECS, lambda spec: Counted(spec.name, delay_ms),
                    cost=lambda spec, engine: 100 * MIB, **kwargs)  # type: ignore[arg-type]


async def test_warm_models_load_at_start_and_others_on_their_first_request() -> None:
    models = made(warm=["b"])
    assert models.served == ["a", "b", "c"] and models.loaded == []
    assert not models.decodes_tools and models.capacity == 2  # the engines' flags
    await models.start()
    assert models.loaded == ["b"] and Counted.log == ["start b"]
    assert await answer(models, "a") == "I am a."
    assert models.loaded == ["b", "a"] and Counted.log == ["start b", "start a"]
    assert await answer(models, "a") == "I am a."  # loaded once
    assert Counted.log == ["start b", "start a"]
    with pytest.raises(EngineError, match="serves a, b, c"):
        await answer(models, "z")
    await models.close()
    assert models.loaded == []


async def test_the_least_recently_used_idle_model_is_evicted_for_the_budget() -> None:
    models = made(budget_bytes=250 * MIB)  # two models fit
    await models.start()
    await answer(models, "b")
    await answer(models, "a")  # a is now the most recently used
    await answer(models, "c")  # b goes
    assert models.loaded == ["a", "c"] and [e for e in Counted.log if "close" in e] == ["close b"]
    assert Counted.log[-2:] == ["close b", "start c"]
    assert await answer(models, "b") == "I am b."  # and comes back, a goes
    assert models.loaded == ["c", "b"]
    await models.close()


async def test_a_busy_model_is_not_evicted_the_load_waits_for_it() -> None:
    models = made(delay_ms=30, budget_bytes=150 * MIB)  # one model at a time
    await models.start()  # a
    long = asyncio.create_task(answer(models, "a"))
    await asyncio.sleep(0.05)  # a is generating
    other = asyncio.create_task(answer(models, "b"))
    await asyncio.sleep(0.03)
    assert not other.done() and models.loaded == ["a"]  # b waits for a to finish
    assert await long == "I am a."
    assert await other == "I am b."
    assert models.loaded == ["b"] and Counted.log == ["start a", "close a", "start b"]
    await models.close()


async def test_a_model_larger_than_the_budget_fails_its_request() -> None:
    models = made(budget_bytes=50 * MIB)
    with pytest.raises(EngineError, match="more than the worker's model budget"):
        await models.start()


def test_warm_models_must_be_served() -> None:
    with pytest.raises(ValueError, match="not among"):
        made(warm=["z"])


class Cached(Counted):
    """A scripted engine with a host cache that saved one sequence per model letter."""

    def host_cache_stats(self) -> HostCache | None:
        return HostCache(saved=ord(self.model) - ord("a") + 1, restored=0, evicted=0,
                         held_bytes=MIB, entries=1)


async def test_the_loaded_models_host_caches_count_together() -> None:
    models = ModelSet(SPECS, lambda spec: Cached(spec.name), warm=["a", "c"],
                      cost=lambda spec, engine: 100 * MIB)  # type: ignore[arg-type]
    counts = host_cache_counts(models)
    assert counts is not None and counts() is None  # nothing loaded yet
    await models.start()
    assert counts() == {"saved": 1 + 3, "restored": 0, "evicted": 0,
                        "held_bytes": 2 * MIB, "entries": 2}
    await models.close()

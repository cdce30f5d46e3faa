"""The llama.cpp engine's host-memory cache of conversations (llamacpp_cache),
with the real SmolLM2-135M GGUF: a conversation whose slot moved on finds
its KV cache again, answers as if it had never left, and the cache keeps to
its bound."""

from __future__ import annotations

import time
from pathlib import Path

from conveyor.registry import Registry
from workers.infer.engines.base import GenerationRequest
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

LIGHTHOUSES = "You are a guide to lighthouses. " + " ".join(
    f"Rule {i}: keep answer {i} short and name sources." for i in range(30))
GLACIERS = "You are a guide to glaciers. " + " ".join(
    f"Rule {i}: never repeat point {i} twice." for i in range(30))
TEA = "You are a guide to tea. " + " ".join(
    f"Rule {i}: say where leaf {i} grows." for i in range(30))
QUESTION = " Question: what is a lens?"


def engine(host_cache_bytes: int) -> LlamaCppBatchEngine:
    """One slot of one batched context: the slot's cache is what moves on."""
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    return LlamaCppBatchEngine.from_spec(spec, sequences=1, contexts=1, n_ctx=1024,
                                         host_cache_bytes=host_cache_bytes)


Made = LlamaCppBatchEngine


async def ask(made: Made, prompt: str, seed: int | None = None) -> tuple[str, float]:
    text, _, took = await asked(made, prompt, seed)
    return text, took


async def asked(made: Made, prompt: str,
                seed: int | None = None) -> tuple[str, int | None, float]:
    """The answer, its cached_tokens, and the seconds it took."""
    req = GenerationRequest(request_id="r", kind="completion", model="smollm2",
                            max_tokens=8, temperature=0.0, seed=seed, prompt_text=prompt)
    start = time.perf_counter()
    pieces = [piece async for piece in made.generate(req)]
    return "".join(p.text for p in pieces), pieces[-1].cached_tokens, time.perf_counter() - start


async def test_a_conversation_finds_its_cache_after_its_slot_moved_on() -> None:
    """One slot, two conversations in turn: the first one's next
    turn is restored from host memory (its history is not evaluated again) and
    gives the answer it gives where the context never left it."""
    cached, plain = engine(256 << 20), engine(0)
    await cached.start()
    await plain.start()
    try:
        first, none, whole = await asked(cached, LIGHTHOUSES)
        assert none == 0
        await ask(cached, GLACIERS)  # takes the only context: lighthouses saved
        assert cached.host_cache is not None
        assert cached.host_cache.stats["saved"] == 1
        answer, reused, restored = await asked(cached, LIGHTHOUSES + QUESTION)
        # the whole first prompt and its answer (less one token) came back: the usage says so
        assert reused is not None and reused > len(LIGHTHOUSES) // 6, reused
        assert cached.host_cache.stats["restored"] == 1
        assert cached.host_cache.stats["entries"] == 1  # glaciers; lighthouses is in the context
        # the control: the next turn where the context still held the first
        assert (await ask(plain, LIGHTHOUSES))[0] == first
        assert answer == (await ask(plain, LIGHTHOUSES + QUESTION))[0]
        # restoring beats evaluating again (about 0.1 s against 2 s alone; beside two
        # other test processes on two cores one sample was 0.50 s against 1.32 s, so
        # a ratio is the benchmark's to hold, not this test's)
        assert restored < whole, (restored, whole)
        # what the worker reports at most: its context, and 256 MiB of 23,040-byte tokens
        assert cached.cache_tokens() == cached.capacity * cached.n_ctx + (256 << 20) // 23_040
        assert plain.cache_tokens() == plain.capacity * plain.n_ctx
        # what the worker's metrics read
        stats = cached.host_cache_stats()
        assert stats is not None and (stats["saved"], stats["restored"]) == (2, 1)
        assert plain.host_cache_stats() is None
    finally:
        await cached.close()
        await plain.close()


async def test_the_cache_keeps_to_its_bound_and_a_seeded_prompt_restores_nothing() -> None:
    """Room for about one conversation: saving a second drops the first (least
    recently used); a seeded prompt saves what it evicts but evaluates afresh."""
    made = engine(12 << 20)  # one 400-token conversation takes about 9.5 MB
    await made.start()
    try:
        cache = made.host_cache
        assert cache is not None
        await ask(made, LIGHTHOUSES)
        await ask(made, GLACIERS)  # lighthouses saved
        await ask(made, TEA)  # glaciers saved, lighthouses dropped for room
        stats = cache.stats
        assert (stats["saved"], stats["evicted"], stats["entries"]) == (2, 1, 1)
        assert cache.stats["held_bytes"] <= cache.capacity_bytes
        await ask(made, GLACIERS + QUESTION)  # glaciers restored (out of the cache), tea saved
        assert (cache.stats["restored"], cache.stats["entries"]) == (1, 1)
        # glaciers and its turn saved, tea dropped for room
        assert (await asked(made, TEA, seed=7))[1] == 0  # a seeded prompt is evaluated afresh
        assert cache.stats["restored"] == 1
        assert (cache.stats["evicted"], cache.stats["entries"]) == (2, 1)
        (held,) = cache._entries.values()  # noqa: SLF001
        spec_text = made._contexts[0].llm.detokenize(list(held.tokens)).decode()  # noqa: SLF001
        assert spec_text.startswith(GLACIERS + QUESTION), spec_text
    finally:
        await made.close()

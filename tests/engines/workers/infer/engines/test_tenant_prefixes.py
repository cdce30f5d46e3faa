"""Tenants' prefixes apart in the llama.cpp engine, with the real SmolLM2-135M
GGUF: a prompt reuses only what prompts of its own ``cache_salt`` left in the
slots and the host cache, so another tenant's identical prompt
gets ``cached_tokens`` 0 and the answer it gets from an empty cache, while
each tenant's next turn still finds its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conveyor.registry import ModelSpec, Registry
from workers.infer.engines.base import GenerationRequest
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

PROMPT = "You are a guide to lighthouses. " + " ".join(
    f"Rule {i}: keep answer {i} short and name sources." for i in range(30))
TURN = " Question: what is a lens?"

Made = LlamaCppBatchEngine


def _spec() -> ModelSpec:
    return Registry.load(Path("conveyor/models.toml")).resolve("smollm2")


def two_slots() -> Made:
    return LlamaCppBatchEngine.from_spec(_spec(), sequences=2, contexts=1, n_ctx=1024)


def one_slot_and_host() -> Made:
    """The one slot moves on: the tenants' prefixes meet in the host cache."""
    return LlamaCppBatchEngine.from_spec(_spec(), sequences=1, contexts=1, n_ctx=1024,
                                         host_cache_bytes=256 << 20)


async def asked(made: Made, prompt: str, salt: str) -> tuple[str, int]:
    """The answer and its cached_tokens."""
    req = GenerationRequest(request_id="r", kind="completion", model="smollm2", max_tokens=8,
                            temperature=0.0, prompt_text=prompt, cache_salt=salt)
    pieces = [piece async for piece in made.generate(req)]
    cached = pieces[-1].cached_tokens
    assert cached is not None
    return "".join(p.text for p in pieces), cached


@pytest.mark.parametrize("make", [two_slots, one_slot_and_host], ids=["slots", "host"])
async def test_another_tenant_s_identical_prompt_reuses_nothing(make: Callable[[], Made]) -> None:
    made = make()
    await made.start()
    try:
        first, fresh = await asked(made, PROMPT, "tenant-a")
        assert fresh == 0
        answer, cached = await asked(made, PROMPT, "tenant-b")
        assert cached == 0  # A's prompt, in a slot or the host cache, is not B's
        assert answer == first
        # each tenant's next turn finds its own prompt (in its slot, or restored)
        _, own_a = await asked(made, PROMPT + TURN, "tenant-a")
        _, own_b = await asked(made, PROMPT + TURN, "tenant-b")
        assert own_a > len(PROMPT) // 6 and own_b > len(PROMPT) // 6, (own_a, own_b)
    finally:
        await made.close()


async def test_prompts_of_one_salt_share_their_prefixes() -> None:
    """The same salt (one tenant, or every tenant where caches are shared)
    reuses as before."""
    made = two_slots()
    await made.start()
    try:
        await asked(made, PROMPT, "")
        _, cached = await asked(made, PROMPT + TURN, "")
        assert cached > len(PROMPT) // 6, cached
    finally:
        await made.close()

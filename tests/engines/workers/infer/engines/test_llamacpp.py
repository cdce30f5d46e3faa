"""LlamaCppEngine with the real SmolLM2-135M GGUF from the registry (CPU): what
only this engine has (its chat template, seeds, contexts, llama.cpp's
failures). The contract every engine keeps (finish reasons, max_tokens, stop
strings, continuations, closing) runs on it in test_contract.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.errors import EngineError
from conveyor.registry import Registry
from schemas.records import Message
from workers.infer.engines.base import GenerationRequest, Piece
from workers.infer.engines.llamacpp import LlamaCppEngine

QUESTION: tuple[Message, ...] = ({"role": "user", "content": "What is the capital of France?"},)
# SmolLM2's chat template, rendered by hand for QUESTION (what preprocess sends).
RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LlamaCppEngine]:
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppEngine.from_spec(spec, contexts=2)
    await engine.start()
    yield engine
    await engine.close()


def request(**overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"request_id": "r1", "kind": "chat", "model": "smollm2-135m-instruct",
                              "max_tokens": 20, "temperature": 0.0, "prompt_text": RENDERED}
    fields.update(overrides)
    return GenerationRequest(**fields)


async def collect(engine: LlamaCppEngine, req: GenerationRequest) -> list[Piece]:
    return [piece async for piece in engine.generate(req)]


def text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


async def test_chat_messages_render_with_the_gguf_template(engine: LlamaCppEngine) -> None:
    rendered_here = await collect(engine, request())
    rendered_by_engine = await collect(engine, request(prompt_text=None, messages=QUESTION))

    assert text(rendered_by_engine) == text(rendered_here)


async def test_same_seed_same_text(engine: LlamaCppEngine) -> None:
    sampled = request(temperature=1.0, seed=1234, max_tokens=12)
    assert text(await collect(engine, sampled)) == text(await collect(engine, sampled))


async def test_generations_run_concurrently(engine: LlamaCppEngine) -> None:
    # Three at once on two contexts: the third waits for a free one.
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(engine, request(max_tokens=8)) for _ in range(3))), timeout=30
    )
    for pieces in results:
        assert pieces[-1].finish_reason is not None
    assert text(results[0]) == text(results[1]) == text(results[2])


async def test_cancelling_frees_the_context(engine: LlamaCppEngine) -> None:
    # Occupy both contexts with long generations and walk away from both.
    long = request(max_tokens=400)  # greedy SmolLM2 never stops on its own here
    for _ in range(2):
        seen = 0
        async for _piece in engine.generate(long):
            seen += 1
            if seen == 2:
                break
    started = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(engine, request(max_tokens=5)) for _ in range(2))), timeout=30
    )
    elapsed = time.monotonic() - started

    assert all(r[-1].finish_reason == "length" for r in results)
    # 400 tokens take several seconds; the abandoned threads stop within a token.
    assert elapsed < 4, elapsed


async def test_failures_become_engine_errors(engine: LlamaCppEngine) -> None:
    too_long = request(prompt_text="hello " * 5000)
    with pytest.raises(EngineError, match="context window"):
        await collect(engine, too_long)
    # The context went back to the pool.
    assert (await collect(engine, request(max_tokens=3)))[-1].finish_reason == "length"


async def test_penalties_reach_llamacpp(engine: LlamaCppEngine) -> None:
    """Greedy, "the cat and the cat and ..." goes on repeating itself; penalised for
    the tokens it already produced (presence once, frequency per occurrence), it
    breaks the loop."""
    loop = request(kind="completion", prompt_text="The cat and the cat and the cat and the",
                   max_tokens=16)
    plain = text(await collect(engine, loop))
    assert plain.count("cat") >= 4, plain
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = text(await collect(engine, request(**{**loop.__dict__, **penalty})))
        assert penalised.count("cat") < plain.count("cat"), (penalty, penalised, plain)


async def test_a_prompt_goes_to_the_free_context_holding_its_prefix() -> None:
    """Contexts are free in turn (the one freed longest ago first), and both
    free here: asked P1, P2 (nothing in common), then P2 continued, the last
    must land where P2 is cached, not overwrite P1; and a fourth prompt
    beginning as P1 does goes where P1 is."""
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppEngine.from_spec(spec, contexts=2)
    await engine.start()
    try:
        one = "Italy is a country in southern Europe. Its capital"
        two = "Rivers of Spain flow to the Atlantic and the Mediterranean. The longest"

        def held() -> list[str]:
            return sorted(c.llm.detokenize(c.llm.input_ids[:c.llm.n_tokens].tolist()).decode()
                          for c in engine._contexts)  # noqa: SLF001

        for prompt in (one, two, two + " is"):
            await collect(engine, request(kind="completion", prompt_text=prompt, max_tokens=2))
        assert held()[0].startswith(one) and held()[1].startswith(two + " is"), held()
        await collect(engine, request(kind="completion", prompt_text=one + " is", max_tokens=2))
        assert held()[0].startswith(one + " is") and held()[1].startswith(two + " is"), held()
    finally:
        await engine.close()


async def test_a_new_prompt_does_not_evict_a_cached_one_for_a_few_shared_tokens() -> None:
    """A prompt sharing only its first words with the prompt one context holds
    takes the empty context: the other one's cache is worth more than those
    few tokens (a conversation's next turn finds it there)."""
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppEngine.from_spec(spec, contexts=2)
    await engine.start()
    try:
        long = ("Italy is a country in southern Europe. Its capital is Rome, its rivers "
                "are the Po and the Tiber, and its mountains are the Alps and the Apennines.")
        await collect(engine, request(kind="completion", prompt_text=long, max_tokens=2))
        await collect(engine, request(kind="completion", prompt_text="Italy is famous for",
                                      max_tokens=2))
        held = sorted(c.llm.detokenize(c.llm.input_ids[:c.llm.n_tokens].tolist()).decode()
                      for c in engine._contexts)  # noqa: SLF001
        assert held[0].startswith(long) and held[1].startswith("Italy is famous for"), held
    finally:
        await engine.close()


async def test_a_new_prompt_evicts_the_least_recently_used_context() -> None:
    """With no context free of a cached prompt, a new conversation takes the
    one used longest ago, not the one holding the shortest (a conversation
    still going on is often the shorter one)."""
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppEngine.from_spec(spec, contexts=2)
    await engine.start()
    try:
        going_on = "Tell me about owls."
        stale = ("Rivers of Spain flow to the Atlantic and to the Mediterranean; the "
                 "longest of them, the Tagus, reaches the sea at Lisbon in Portugal.")
        for prompt in (going_on, stale, going_on + " And bats?", "Clocks tick."):
            await collect(engine, request(kind="completion", prompt_text=prompt, max_tokens=2))
        held = [c.llm.detokenize(c.llm.input_ids[:c.llm.n_tokens].tolist()).decode()
                for c in engine._contexts]  # noqa: SLF001
        assert any(h.startswith(going_on + " And bats?") for h in held), held
        assert not any(h.startswith(stale) for h in held), held
    finally:
        await engine.close()

"""logit_bias and logprobs on both llama.cpp engines with the real SmolLM2-135M GGUF: a
token pushed to -100 is never sampled, one pushed to +100 is all the answer
holds, and a token outside the vocabulary is a 400 naming logit_bias, not a
crashed process (llama.cpp's sampler indexes the logits by token id); the
log probabilities reported are the model's own, the greedy token the most
likely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llama_cpp import Llama

from conveyor.errors import InvalidRequest
from conveyor.registry import Registry
from workers.infer.engines.base import Engine, GenerationRequest

SPEC = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def vocab() -> Llama:
    return Llama(model_path=str(SPEC.gguf_path()), vocab_only=True, verbose=False)


@pytest.fixture
def engine(llama_engine: Engine) -> Engine:
    return llama_engine  # each llama.cpp engine (conftest.py)


def ask(**overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"request_id": "r1", "kind": "completion", "model": "smollm2",
                              "max_tokens": 6, "temperature": 0.0, "prompt_text": PROMPT}
    fields.update(overrides)
    return GenerationRequest(**fields)


async def answer(engine: Engine, req: GenerationRequest) -> str:
    return "".join([p.text async for p in engine.generate(req)])


async def test_a_banned_token_is_never_sampled_and_a_forced_one_is_all(
        engine: Engine, vocab: Llama) -> None:
    free = await answer(engine, ask())
    first = vocab.tokenize(free.encode(), add_bos=False)[0]
    banned = await answer(engine, ask(logit_bias=((first, -100.0),)))
    assert banned and first not in vocab.tokenize(banned.encode(), add_bos=False), (free, banned)
    [forced] = vocab.tokenize(b" Paris", add_bos=False)
    assert await answer(engine, ask(logit_bias=((forced, 100.0),))) == " Paris" * 6


async def test_a_token_outside_the_vocabulary_is_refused(engine: Engine, vocab: Llama) -> None:
    with pytest.raises(InvalidRequest) as info:
        await answer(engine, ask(logit_bias=((vocab.n_vocab(), 5.0),)))
    assert info.value.param == "logit_bias"
    assert await answer(engine, ask())  # and the engine serves on


async def test_logprobs_are_the_models_own_and_the_greedy_token_is_the_likeliest(
        engine: Engine) -> None:
    """Temperature 0 samples the most likely token: its log probability is the
    first of the top ones; the tokens' bytes are the answer's, and a biased
    draw still reports the model's own distribution."""
    pieces = [p async for p in engine.generate(ask(max_tokens=8, logprobs=True,
                                                   top_logprobs=3))]
    text = "".join(p.text for p in pieces)
    entries = [e for p in pieces for e in p.logprobs]
    assert len(entries) == 8 and b"".join(e["bytes"] for e in entries) == text.encode()
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top"]) == 3
        assert [t["logprob"] for t in e["top"]] == sorted(
            (t["logprob"] for t in e["top"]), reverse=True)
        assert e["top"][0]["logprob"] == pytest.approx(e["logprob"])
        assert e["top"][0]["bytes"] == e["bytes"]
    plain = [p async for p in engine.generate(ask(max_tokens=8))]
    assert not any(p.logprobs for p in plain)

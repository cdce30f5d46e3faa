"""ScriptedEngine: what each script answers, and the exact resumes, stops and
slots the contract tests (test_contract.py) can only check loosely."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from conveyor.errors import EngineError
from schemas.records import Message
from workers.infer.engines.base import GenerationRequest, Piece
from workers.infer.engines.scripted import DEFAULT_TEXT, ScriptedEngine, pieces_of

CHAT: tuple[Message, ...] = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello to the world"},
    {"role": "assistant", "content": "Hello world"},
    {"role": "user", "content": "Once more, with feeling"},
)


@pytest.fixture
def engine_of(started_engines: Callable[[Any], Awaitable[Any]]) -> Any:
    async def make(*args: Any, **kwargs: Any) -> ScriptedEngine:
        engine: ScriptedEngine = await started_engines(ScriptedEngine(*args, **kwargs))
        return engine

    return make


def request(**overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"request_id": "r1", "kind": "chat", "model": "m",
                              "max_tokens": 100, "messages": CHAT, "prompt_text": "<rendered>"}
    fields.update(overrides)
    return GenerationRequest(**fields)


def completion(prompt: str, **overrides: Any) -> GenerationRequest:
    return request(kind="completion", prompt_text=prompt, messages=(), **overrides)


async def collect(engine: ScriptedEngine, req: GenerationRequest) -> list[Piece]:
    return [piece async for piece in engine.generate(req)]


def text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


def test_tokens_join_back_into_the_text() -> None:
    for sample in ("", " ", "a", "  two  spaces  ", "line\nbreak\n\n", DEFAULT_TEXT):
        assert "".join(pieces_of(sample)) == sample
    assert pieces_of("Hello, big world.") == ["Hello,", " big", " world."]


async def test_echo_answers_the_last_user_message(engine_of: Any) -> None:
    engine = await engine_of()
    pieces = await collect(engine, request())

    assert [p.text for p in pieces] == ["Once", " more,", " with", " feeling", ""]
    assert [p.finish_reason for p in pieces] == [None, None, None, None, "stop"]
    assert [p.tokens for p in pieces] == [1, 1, 1, 1, 1]  # the end token counts


async def test_echo_answers_a_completion_with_its_prompt(engine_of: Any) -> None:
    engine = await engine_of("echo")

    assert text(await collect(engine, completion("Once upon a time"))) == "Once upon a time"
    assert text(await collect(engine, request(messages=()))) == "<rendered>"


async def test_text_answers_every_request_alike(engine_of: Any) -> None:
    engine = await engine_of("text", text="Fixed answer here.")

    assert text(await collect(engine, request())) == "Fixed answer here."
    assert text(await collect(engine, completion("anything"))) == "Fixed answer here."


async def test_count_goes_on_after_the_last_number(engine_of: Any) -> None:
    engine = await engine_of("count")
    pieces = await collect(engine, completion("1, 2, 3, 4, 5,", max_tokens=4))

    assert [p.text for p in pieces] == [" 6,", " 7,", " 8,", " 9,"]
    assert pieces[-1].finish_reason == "length"
    assert text(await collect(engine, request(max_tokens=2))) == " 1, 2,"  # no number: from 1


async def test_sampling_does_not_change_the_answer(engine_of: Any) -> None:
    engine = await engine_of("count")
    greedy = text(await collect(engine, completion("7", max_tokens=10, temperature=0)))

    for kwargs in ({"temperature": 1.0}, {"temperature": 1.5, "top_p": 0.5},
                   {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        assert text(await collect(engine, completion("7", max_tokens=10, **kwargs))) == greedy


async def test_max_tokens_counts_the_end_token(engine_of: Any) -> None:
    engine = await engine_of("text", text="one two three")

    exact = await collect(engine, request(max_tokens=3))
    assert [p.text for p in exact] == ["one", " two", " three"]
    assert exact[-1].finish_reason == "length"  # no room left for the end token
    roomy = await collect(engine, request(max_tokens=4))
    assert roomy[-1] == Piece("", 1, "stop")
    assert sum(p.tokens for p in roomy) == 4
    assert (await collect(engine, request(max_tokens=0)))[-1] == Piece("one", 1, "length")


@pytest.mark.parametrize("script", ["echo", "count", "text"])
async def test_a_resumed_answer_is_the_uninterrupted_one(engine_of: Any, script: str) -> None:
    engine = await engine_of(script)
    asked = ({"role": "user", "content": DEFAULT_TEXT + " 3 more, with"},)
    for max_tokens in (12, 40):
        for stop in ((), (" with",), ("ore, w",), (" 9,",), ("answers",), ("nowhere",)):
            whole = await collect(engine, request(max_tokens=max_tokens, stop=stop,
                                                  messages=asked))
            for cut in range(len(whole)):
                sent = whole[:cut]  # what a run sent before it died
                rest = await collect(engine, request(
                    max_tokens=max_tokens - sum(p.tokens for p in sent), stop=stop,
                    continuation=text(sent), messages=asked))
                assert text(sent) + text(rest) == text(whole), (script, stop, cut)
                assert rest[-1].finish_reason == whole[-1].finish_reason
                assert sum(p.tokens for p in sent + rest) == sum(p.tokens for p in whole)


async def test_a_continuation_off_the_token_boundaries_goes_on_after_the_next_one(
        engine_of: Any) -> None:
    engine = await engine_of("text", text="alpha beta gamma delta")

    assert text(await collect(engine, request(continuation="alpha"))) == " beta gamma delta"
    assert text(await collect(engine, request(continuation="alp"))) == " beta gamma delta"
    assert text(await collect(engine, request(continuation="alpha b"))) == " gamma delta"
    assert await collect(engine, request(continuation="x" * 99)) == [Piece("", 1, "stop")]


async def test_stop_strings(engine_of: Any) -> None:
    engine = await engine_of("text", text="alpha beta gamma delta")

    inside = await collect(engine, request(stop=("mma",)))
    assert [p.text for p in inside] == ["alpha", " beta", " ga"]
    assert inside[-1].finish_reason == "stop"
    # at a token's start: the token where it begins counts, its text does not
    assert await collect(engine, request(stop=(" gamma",))) == [
        Piece("alpha"), Piece(" beta"), Piece("", 1, "stop")]
    # across tokens, the earliest of several, and an empty one ignored
    assert text(await collect(engine, request(stop=("", "delta", "a be")))) == "alph"
    # beyond max_tokens it is never reached
    assert (await collect(engine, request(stop=("delta",), max_tokens=2)))[-1] == \
        Piece(" beta", 1, "length")


async def test_never_more_than_capacity_at_once(engine_of: Any) -> None:
    engine = await engine_of("count", capacity=3, token_delay_ms=1)
    seen: list[int] = []

    async def one() -> None:
        async for _piece in engine.generate(request(max_tokens=10)):
            seen.append(engine.running)

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(10))), timeout=10)
    assert max(seen) == 3
    assert engine.running == 0


async def test_aclose_and_cancel_free_the_slot_at_once(engine_of: Any) -> None:
    engine = await engine_of("count", capacity=1, token_delay_ms=1)
    pieces = engine.generate(request())
    await anext(pieces)
    assert engine.running == 1
    await pieces.aclose()
    assert engine.running == 0

    consumer = asyncio.create_task(collect(engine, request(max_tokens=10_000)))
    await asyncio.sleep(0.05)
    assert engine.running == 1
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert engine.running == 0


async def test_a_waiting_generation_is_ended_by_close(engine_of: Any) -> None:
    engine = await engine_of("count", capacity=1)
    holding = engine.generate(request())
    await anext(holding)
    waiting = asyncio.create_task(collect(engine, request()))
    await asyncio.sleep(0.01)
    await engine.close()

    with pytest.raises(EngineError, match="cancelled"):
        await anext(holding)
    with pytest.raises(EngineError, match="cancelled"):
        await asyncio.wait_for(waiting, timeout=5)
    with pytest.raises(EngineError, match="not started"):
        await collect(engine, request())


async def test_each_token_takes_the_delay(engine_of: Any) -> None:
    engine = await engine_of("count", token_delay_ms=20)
    started = time.monotonic()
    pieces = await collect(engine, request(max_tokens=5))

    assert len(pieces) == 5
    assert time.monotonic() - started >= 5 * 0.02


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ScriptedEngine(capacity=0)
    with pytest.raises(ValueError, match="token_delay_ms"):
        ScriptedEngine(token_delay_ms=-1)
    with pytest.raises(ValueError, match="script"):
        ScriptedEngine(cast(Any, "poem"))

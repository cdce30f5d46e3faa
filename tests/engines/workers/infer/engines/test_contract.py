"""The engine contract (workers/infer/engines/base.py), checked the same way on
the scripted engine and on the real llama.cpp engines, one context per sequence
and batching (SmolLM2-135M, CPU): the
scripted engine stands in for the real one in the pipeline tests only because
it passes these.

The llama.cpp engine is loaded once for the module (two contexts); only the
test of ``close`` loads one of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conveyor.errors import EngineError
from conveyor.registry import Registry
from schemas.records import Message
from workers.infer.engines.base import Engine, GenerationRequest, Piece
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine
from workers.infer.engines.scripted import ScriptedEngine

QUESTION: tuple[Message, ...] = ({"role": "user", "content": "What is the capital of France?"},)
# SmolLM2's chat template, rendered for QUESTION (what preprocess sends)
RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CAPACITY = 2

MakeEngine = Callable[[int], Awaitable[Engine]]


def _llamacpp(contexts: int) -> Engine:
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    return LlamaCppBatchEngine.from_spec(spec, sequences=contexts)


def _scripted(contexts: int) -> Engine:
    # a little time per token, so that generations really interleave
    return ScriptedEngine(capacity=contexts, token_delay_ms=2)


def _scripted_count(contexts: int) -> Engine:
    # the script that never ends on its own: long answers run on, as llama.cpp's do
    return ScriptedEngine("count", capacity=contexts, token_delay_ms=2)


ENGINES: dict[str, Callable[[int], Engine]] = {
    "scripted": _scripted, "scripted-count": _scripted_count, "llamacpp": _llamacpp}


@pytest.fixture(scope="module", params=list(ENGINES))
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
async def engine(kind: str) -> AsyncIterator[Engine]:
    started = ENGINES[kind](CAPACITY)
    await started.start()
    yield started
    await started.close()


@pytest.fixture
def make_engine(kind: str, started_engines: Callable[[Any], Awaitable[Any]]) -> MakeEngine:
    """Another engine of the same kind, started, closed after the test."""

    async def make(capacity: int) -> Engine:
        own: Engine = await started_engines(ENGINES[kind](capacity))
        return own

    return make


def request(**overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"request_id": "r1", "kind": "chat", "model": "smollm2-135m-instruct",
                              "max_tokens": 20, "temperature": 0.0, "prompt_text": RENDERED,
                              "messages": QUESTION}
    fields.update(overrides)
    return GenerationRequest(**fields)


# greedy SmolLM2 does not stop on its own within 400 tokens here, nor does the
# count script; an echo is shorter, but holds its slot until it is closed too
LONG = request(max_tokens=400)


async def collect(engine: Engine, req: GenerationRequest) -> list[Piece]:
    return [piece async for piece in engine.generate(req)]


def text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


def assert_well_formed(pieces: list[Piece], max_tokens: int) -> None:
    """Only the last piece ends the answer; the tokens add up within max_tokens."""
    assert pieces and pieces[-1].finish_reason in ("stop", "length")
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert all(p.tokens >= 0 for p in pieces)
    assert 1 <= sum(p.tokens for p in pieces) <= max_tokens


async def test_an_answer_is_pieces_then_a_finish_reason(engine: Engine) -> None:
    pieces = await collect(engine, request())

    assert text(pieces).strip()
    assert_well_formed(pieces, 20)


async def test_max_tokens_ends_with_length_and_the_tokens_add_up(engine: Engine) -> None:
    pieces = await collect(engine, request(max_tokens=3))

    assert_well_formed(pieces, 3)
    assert pieces[-1].finish_reason == "length"
    assert sum(p.tokens for p in pieces) == 3


async def test_temperature_zero_gives_one_answer(engine: Engine) -> None:
    first = text(await collect(engine, request(max_tokens=10)))
    second = text(await collect(engine, request(max_tokens=10)))
    seeded = request(temperature=1.0, seed=1234, max_tokens=10)

    assert first == second
    if getattr(engine, "reproducible_seeds", True):  # the batching engine's notes say why not
        assert text(await collect(engine, seeded)) == text(await collect(engine, seeded))


async def test_concurrent_generations_give_the_same_answer(engine: Engine) -> None:
    # one more than the engine runs at once: the last waits for a free slot
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(engine, request(max_tokens=8))
                         for _ in range(engine.capacity + 1))), timeout=60)

    for pieces in results:
        assert_well_formed(pieces, 8)
    assert len({text(pieces) for pieces in results}) == 1


async def test_chat_messages_alone_are_answered(engine: Engine) -> None:
    pieces = await collect(engine, request(prompt_text=None))

    assert text(pieces).strip()
    assert_well_formed(pieces, 20)


async def test_an_empty_completion_prompt_is_answered(engine: Engine) -> None:
    pieces = await collect(engine, request(kind="completion", prompt_text="", messages=(),
                                           max_tokens=4))

    assert_well_formed(pieces, 4)


async def test_a_stop_string_ends_the_answer_before_it(engine: Engine) -> None:
    answer = text(await collect(engine, request()))
    stop = answer[len(answer) // 2:][:3]
    pieces = await collect(engine, request(stop=(stop,)))

    assert text(pieces) == answer[: answer.index(stop)]
    assert pieces[-1].finish_reason == "stop"


async def test_a_continuation_goes_on_after_the_text_sent(engine: Engine) -> None:
    pieces = await collect(engine, request())
    sent = [p for p in pieces if p.text][:3]  # what an earlier run sent before it died
    continuation = text(sent)
    rest = await collect(engine, request(continuation=continuation,
                                         max_tokens=20 - sum(p.tokens for p in sent)))

    assert text(rest).strip()
    assert not text(rest).lstrip().startswith(continuation.strip())  # not started over
    assert_well_formed(rest, 20 - len(sent))


async def test_closing_a_generation_frees_its_slot(engine: Engine) -> None:
    # occupy every slot with a long answer and walk away from each
    for _ in range(engine.capacity):
        pieces = engine.generate(LONG)
        await anext(pieces)
        await anext(pieces)
        await pieces.aclose()
    started = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(engine, request(max_tokens=5))
                         for _ in range(engine.capacity))), timeout=30)

    assert all(r[-1].finish_reason == "length" for r in results)
    # 400 tokens of llama.cpp take several seconds; it stops within a token
    assert time.monotonic() - started < 4


async def test_no_more_than_capacity_run_at_once(engine: Engine) -> None:
    running: list[AsyncGenerator[Piece, None]] = []
    for _ in range(engine.capacity):
        running.append(engine.generate(LONG))
        await anext(running[-1])
    extra = engine.generate(request(max_tokens=3))
    first = asyncio.create_task(anext(extra))
    try:
        done, _ = await asyncio.wait({first}, timeout=0.5)
        assert not done, "a generation ran beyond the engine's capacity"
        await running.pop().aclose()  # one slot frees: the waiting one starts
        assert isinstance(await asyncio.wait_for(first, timeout=10), Piece)
    finally:
        first.cancel()
        await extra.aclose()
        for pieces in running:
            await pieces.aclose()


async def test_a_closed_consumer_task_frees_its_slot(engine: Engine) -> None:
    async def consume() -> None:
        async for _piece in engine.generate(LONG):
            pass

    tasks = [asyncio.create_task(consume()) for _ in range(engine.capacity)]
    await asyncio.sleep(0.3)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pieces = await asyncio.wait_for(collect(engine, request(max_tokens=3)), timeout=10)

    assert pieces[-1].finish_reason == "length"


async def test_an_engine_not_started_refuses_with_an_engine_error(kind: str) -> None:
    idle = ENGINES[kind](1)

    with pytest.raises(EngineError, match="not started"):
        await collect(idle, request())


async def test_close_ends_a_running_generation_with_an_engine_error(
        make_engine: MakeEngine) -> None:
    own = await make_engine(1)
    pieces = own.generate(LONG)
    await anext(pieces)
    closing = asyncio.create_task(own.close())

    async def drain() -> None:
        async for _piece in pieces:
            pass

    with pytest.raises(EngineError, match="cancelled"):
        await asyncio.wait_for(drain(), timeout=10)
    await asyncio.wait_for(closing, timeout=10)

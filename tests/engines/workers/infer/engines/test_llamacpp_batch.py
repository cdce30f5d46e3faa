"""LlamaCppBatchEngine with the real SmolLM2-135M GGUF from the registry (CPU):
sequences decoded together in two contexts, routed between them, their slots
freed on cancel, prefix reuse, and greedy answers that do not depend on what
runs beside them nor on the context. Answers are kept short: the whole module
runs in well under a minute on two cores."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from conveyor.errors import EngineError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from workers.infer.engines.base import GenerationRequest, Piece
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine, _shares
from workers.infer.engines.llamacpp_batch_context import Context, Text
from workers.infer.engines.model_set import ModelSet
from workers.infer.engines.table import EngineOptions

SEQUENCES = 4


def chat(question: str) -> str:
    """SmolLM2's chat template rendered for one question (what preprocess sends)."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            f"Hugging Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


QUESTION = chat("What is the capital of France?")
OTHERS = [chat("Write a haiku about autumn leaves."), chat("Why is the sky blue?"),
          chat("List three uses of a paperclip."), "Once upon a time"]


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LlamaCppBatchEngine]:
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppBatchEngine.from_spec(spec, sequences=SEQUENCES, contexts=2, n_ctx=512)
    await engine.start()
    yield engine
    await engine.close()


def request(prompt: str = QUESTION, **overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"request_id": "r1", "kind": "chat", "model": "smollm2-135m-instruct",
                              "max_tokens": 8, "temperature": 0.0, "prompt_text": prompt}
    fields.update(overrides)
    return GenerationRequest(**fields)


async def collect(engine: LlamaCppBatchEngine, req: GenerationRequest) -> list[Piece]:
    return [piece async for piece in engine.generate(req)]


def text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


async def answer(engine: LlamaCppBatchEngine, req: GenerationRequest) -> str:
    return text(await collect(engine, req))


# -- text handling, no model ------------------------------------------------------------


def test_a_character_split_over_tokens_is_sent_whole() -> None:
    t = Text(())
    e_acute = "é".encode()

    assert t.push(b"caf" + e_acute[:1]) == ("caf", False)
    assert t.push(e_acute[1:]) == ("é", False)


def test_text_that_may_begin_a_stop_string_is_held_back() -> None:
    t = Text(("END",))

    assert t.push(b"ab E") == ("ab ", False)
    assert t.push(b"x") == ("Ex", False)  # not the stop after all
    assert t.push(b" EN") == (" ", False)
    assert t.push(b"D and more") == ("", True)  # nothing past the stop
    assert Text(("END",)).push(b"zz") == ("zz", False)


# -- contexts and routing, no model -------------------------------------------------------


def test_the_sequences_are_dealt_out_over_the_contexts() -> None:
    assert _shares(16, 2) == [8, 8] and _shares(5, 2) == [3, 2] and _shares(4, 1) == [4]
    engine = LlamaCppBatchEngine(Path("model.gguf"), sequences=1, contexts=2)
    assert (engine.capacity, engine.contexts) == (1, 1)  # a context holds one at least


def test_the_table_reads_sequences_from_contexts_and_contexts_from_batches() -> None:
    parser = argparse.ArgumentParser()
    EngineOptions.add_flags(parser)
    registry = Registry.load(Path("conveyor/models.toml"))
    made_set = EngineOptions.from_args(parser.parse_args(
        ["--engine", "llamacpp", "--contexts", "16", "--batches", "3", "--threads", "2"]
    )).make(registry, load_settings())
    default_set = EngineOptions().make(registry, load_settings())
    # the worker's models, an engine each (workers/infer/engines/model_set.py)
    assert isinstance(made_set, ModelSet) and isinstance(default_set, ModelSet)
    assert made_set.served == default_set.served == ["smollm2-135m-instruct"]
    # what each set's factory makes of the model (the set makes its engines so)
    made = made_set.make(made_set.specs["smollm2-135m-instruct"])
    default = default_set.make(default_set.specs["smollm2-135m-instruct"])

    assert isinstance(made, LlamaCppBatchEngine) and isinstance(default, LlamaCppBatchEngine)
    assert (made.capacity, made.contexts, made.n_threads) == (16, 3, 2)
    assert (default.capacity, default.contexts, default.n_threads) == (2, 2, 1)  # one a core


@dataclass(eq=False)
class _Held:
    """What routing reads of a context: its room, its load and the prefix it holds."""

    share: int
    assigned: int
    prefix: int

    salt: str = ""

    def reusable(self, tokens: list[int], salt: str) -> int:
        return self.prefix if salt == self.salt else 0


def route(held: list[_Held], reuse: bool = True, salt: str = "") -> int:
    engine = LlamaCppBatchEngine(Path("model.gguf"), sequences=16, contexts=len(held),
                                 prefill_chunk=128)
    engine._contexts = cast(list[Context], held)
    return held.index(cast(_Held, engine._route([1] * 400, salt, reuse=reuse)))


def test_a_sequence_goes_to_the_least_busy_context_the_longer_prefix_breaking_ties() -> None:
    assert route([_Held(8, 1, 0), _Held(8, 0, 0)]) == 1
    assert route([_Held(8, 1, 30), _Held(8, 0, 0)]) == 1  # a shared system prompt
    assert route([_Held(8, 0, 30), _Held(8, 0, 37)]) == 1
    assert route([_Held(8, 0, 37), _Held(8, 0, 30)], reuse=False) == 0


def test_a_busier_context_wins_a_sequence_by_a_prefix_a_chunk_longer() -> None:
    assert route([_Held(8, 3, 300), _Held(8, 0, 100)]) == 0
    assert route([_Held(8, 3, 227), _Held(8, 0, 100)]) == 1
    assert route([_Held(8, 8, 300), _Held(8, 0, 0)]) == 1  # no room there
    assert route([_Held(8, 3, 300), _Held(8, 0, 0)], reuse=False) == 1


def test_a_prefix_another_tenant_left_wins_no_sequence() -> None:
    assert route([_Held(8, 3, 300, "a"), _Held(8, 0, 0, "b")], salt="b") == 1
    assert route([_Held(8, 0, 37, "a"), _Held(8, 0, 30, "b")], salt="b") == 1


# -- the engine -----------------------------------------------------------------------


async def test_an_answer_streams_and_its_tokens_add_up(engine: LlamaCppBatchEngine) -> None:
    pieces = await collect(engine, request(max_tokens=6))

    assert len(pieces) > 1 and text(pieces).strip()
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert pieces[-1].finish_reason == "length"
    assert sum(p.tokens for p in pieces) == 6
    assert pieces[-1].prompt_tokens == 37


async def test_a_stop_string_ends_the_answer_before_it(engine: LlamaCppBatchEngine) -> None:
    full = await answer(engine, request(max_tokens=12))
    stop = full[len(full) // 2:][:3]
    pieces = await collect(engine, request(max_tokens=12, stop=(stop,)))

    assert text(pieces) == full[:full.index(stop)]
    assert pieces[-1].finish_reason == "stop"
    assert sum(p.tokens for p in pieces) <= 12


def reused_tokens(engine: LlamaCppBatchEngine) -> int:
    """Prompt tokens taken from the caches instead of evaluated, so far."""
    kv = engine.kv_state()
    assert kv is not None
    return kv["prefix_hits"]


async def test_sequences_decoded_together_answer_as_they_do_alone(
        engine: LlamaCppBatchEngine) -> None:
    prompts = [QUESTION, *OTHERS[:SEQUENCES - 1]]
    alone = [await answer(engine, request(p)) for p in prompts]
    started = reused_tokens(engine)
    together = await asyncio.gather(*(answer(engine, request(p)) for p in prompts))

    assert together == alone
    assert reused_tokens(engine) > started  # each slot held a prompt like its next one


async def test_streams_are_spread_over_the_contexts_and_answer_alike(
        engine: LlamaCppBatchEngine) -> None:
    before = [c.prompt_tokens for c in engine._contexts]
    answers = await asyncio.gather(*(answer(engine, request()) for _ in range(2)))

    assert answers[0] == answers[1]
    assert [c.prompt_tokens - b for c, b in zip(engine._contexts, before, strict=True)] == [
        37, 37]


async def test_a_prefix_in_the_cache_is_reused(engine: LlamaCppBatchEngine) -> None:
    fresh = await collect(engine, request(seed=7))  # a seed evaluates afresh
    before = reused_tokens(engine)
    reused = await collect(engine, request())

    assert fresh[-1].cached_tokens == 0
    cached = reused[-1].cached_tokens
    assert cached is not None and 30 <= cached < 37  # the last prompt token is evaluated
    assert reused_tokens(engine) - before == cached
    assert text(reused) == text(fresh)


async def test_a_repeated_prompt_reuses_its_slot_after_a_longer_answer(
        engine: LlamaCppBatchEngine) -> None:
    # its answer (24 tokens) longer than it: the slot holding it scored 0 once, and
    # the repeat was evaluated afresh in another slot
    ask = request("In a quiet village by the sea there lived", kind="completion",
                  max_tokens=24)
    first = await collect(engine, ask)
    again = await collect(engine, ask)

    prompt = first[-1].prompt_tokens
    assert prompt is not None and first[-1].finish_reason == "length"
    assert again[-1].cached_tokens == prompt - 1  # all but the last prompt token
    assert text(again) == text(first)


async def test_the_kv_state_counts_cells_running_kept_and_reused(
        engine: LlamaCppBatchEngine) -> None:
    await collect(engine, request())
    idle = engine.kv_state()
    assert idle is not None and idle["usage"] == 0.0 and idle["block_tokens"] == 1
    assert idle["total_blocks"] == SEQUENCES * 512 == idle["free_blocks"]
    kept = idle["cached_blocks"]
    assert kept is not None and kept >= 37  # the prompt, kept
    running = engine.generate(request(OTHERS[1], max_tokens=200))
    await anext(running)
    busy = engine.kv_state()
    assert busy is not None and 0 < busy["usage"] < 1
    used = round(busy["usage"] * busy["total_blocks"])
    assert busy["free_blocks"] == busy["total_blocks"] - used
    await running.aclose()
    await collect(engine, request())  # the system prompt it shares is found in the cache
    after = engine.kv_state()
    assert after is not None and after["prefix_queries"] - busy["prefix_queries"] >= 37
    assert after["prefix_hits"] - busy["prefix_hits"] >= 20


async def test_one_question_asked_20_times_beside_others_gets_one_answer(
        engine: LlamaCppBatchEngine) -> None:
    ask = request(max_tokens=6)
    expected = await answer(engine, ask)
    rng = random.Random(13)
    answers = []
    for _ in range(20):
        beside = [asyncio.create_task(answer(engine, request(rng.choice(OTHERS),
                                                             max_tokens=rng.randint(2, 8))))
                  for _ in range(rng.randint(1, SEQUENCES - 1))]
        await asyncio.sleep(rng.random() * 0.1)  # join at another step of theirs
        answers.append(await answer(engine, ask))
        await asyncio.gather(*beside)

    assert answers == [expected] * 20


async def test_closing_a_generation_frees_its_sequence(engine: LlamaCppBatchEngine) -> None:
    for _ in range(SEQUENCES):  # every sequence busy with a long answer, then walked away from
        pieces = engine.generate(request(max_tokens=400))
        await anext(pieces)
        await anext(pieces)
        await pieces.aclose()
    started = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(engine, request(max_tokens=4)) for _ in range(SEQUENCES))),
        timeout=30)

    assert all(r[-1].finish_reason == "length" for r in results)
    assert time.monotonic() - started < 5  # 4 x 400 tokens would take far longer


async def test_a_prompt_longer_than_a_sequence_context_is_refused(
        engine: LlamaCppBatchEngine) -> None:
    with pytest.raises(EngineError, match="context window of 512 tokens"):
        await collect(engine, request("hello " * 600))
    assert (await collect(engine, request(max_tokens=2)))[-1].finish_reason == "length"


async def test_close_ends_what_runs_with_an_engine_error() -> None:
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppBatchEngine.from_spec(spec, sequences=2, n_ctx=256)
    await engine.start()
    pieces = engine.generate(request(max_tokens=400))
    await anext(pieces)
    await engine.close()

    with pytest.raises(EngineError):
        async for _ in pieces:
            pass
    with pytest.raises(EngineError, match="not started"):
        await collect(engine, request())


async def test_penalties_reach_the_sampler_chain() -> None:
    """Greedy, "the cat and the cat and ..." repeats itself; penalised for what it
    already produced (presence once, frequency per occurrence), it breaks the loop."""
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engine = LlamaCppBatchEngine.from_spec(spec, sequences=2)
    await engine.start()
    try:
        loop = GenerationRequest(request_id="r", kind="completion", model="smollm2",
                                 max_tokens=16, temperature=0.0,
                                 prompt_text="The cat and the cat and the cat and the")
        plain = "".join([p.text async for p in engine.generate(loop)])
        assert plain.count("cat") >= 4, plain
        for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
            penalised = "".join([p.text async for p in engine.generate(
                GenerationRequest(**{**loop.__dict__, **penalty}))])
            assert penalised.count("cat") < plain.count("cat"), (penalty, penalised, plain)
    finally:
        await engine.close()

"""Enums on both llama.cpp engines with the real SmolLM2-135M GGUF. An enum's
grammar is a trie of its values (schemas/structured.py): a 10,000-string enum
decodes near the free rate (as a flat alternation it decoded at a twentieth
of it or less: llama.cpp's sampler carried all 10,000 alternatives from token
to token), its answers are the enum's values, an answer cut inside a value is
continued into one; and the grammar holds every value's JSON text exactly,
escapes and all."""

from __future__ import annotations

import ctypes
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import llama_cpp
import pytest
from llama_cpp import Llama

from conveyor.errors import EngineError
from conveyor.registry import Registry
from schemas.answer_format import violation
from schemas.records import ResponseFormat
from workers.infer.engines.base import Engine, GenerationRequest
from workers.infer.engines.llamacpp_grammar import checked_prefix, grammar_sampler

SPEC = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
VALUES = [f"item-{i:05d}" for i in range(10_000)]
PICKS: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["picks"],
    "properties": {"picks": {"type": "array", "minItems": 3, "maxItems": 6,
                             "items": {"enum": VALUES}}}}
HELD = ResponseFormat(type="json_schema", name="picks", schema=json.dumps(PICKS), strict=True)
QUESTION = "Pick a few items from the catalog for a new customer, as JSON."
# the held side's decode rate against the free side's, at least: a trie made
# 0.9-1.0 of it here, the flat alternation 0.02-0.06
SHARE = 0.25


@pytest.fixture
def engine(llama_engine: Engine) -> Engine:
    return llama_engine  # each llama.cpp engine (conftest.py)


@pytest.fixture(scope="module")
def vocab() -> Llama:
    return Llama(model_path=str(SPEC.gguf_path()), vocab_only=True, verbose=False)


def ask(fmt: ResponseFormat | None, **overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "request_id": "r1", "kind": "chat", "model": "smollm2-135m-instruct",
        "max_tokens": 100, "temperature": 0.0, "response_format": fmt,
        "messages": ({"role": "user", "content": QUESTION},)}
    fields.update(overrides)
    return GenerationRequest(**fields)


async def timed(engine: Engine, req: GenerationRequest) -> tuple[str, int, float]:
    """The answer, its tokens after the first, and the time from its first token
    to its last (prompt evaluation left out: it is the same on both sides)."""
    text, tokens, first, last = [], 0, 0.0, 0.0
    async for piece in engine.generate(req):
        now = time.perf_counter()
        first, last = first or now, now
        text.append(piece.text)
        tokens += piece.tokens
    return "".join(text), tokens - 1, last - first


async def test_a_10000_string_enum_decodes_near_the_free_rate(engine: Engine) -> None:
    await timed(engine, ask(HELD, max_tokens=4))  # the grammar compiled, the prompt cached
    sides: dict[bool, list[float]] = {False: [0, 0.0], True: [0, 0.0]}
    answers = []
    for held in (False, True, True, False):  # alternated: the machine's drift falls on both
        text, tokens, seconds = await timed(engine, ask(HELD if held else None))
        sides[held][0] += tokens
        sides[held][1] += seconds
        if held:
            answers.append(text)
    for text in answers:
        assert violation(HELD, text) is None, text
        assert set(json.loads(text)["picks"]) <= set(VALUES)
    free, held_rate = (sides[k][0] / sides[k][1] for k in (False, True))
    assert held_rate >= SHARE * free, (held_rate, free)


async def test_an_answer_cut_inside_a_value_is_continued_into_one(engine: Engine) -> None:
    whole = "".join([p.text async for p in engine.generate(ask(HELD, temperature=0.8, seed=3))])
    cut = whole[:whole.index("item-") + 7]  # inside the first value: '..."item-0'
    rest = "".join([p.text async for p in engine.generate(
        ask(HELD, temperature=0.8, seed=5, continuation=cut))])
    assert violation(HELD, cut + rest) is None, cut + rest
    assert set(json.loads(cut + rest)["picks"]) <= set(VALUES)


TRICKY = ["a", "ab", "abc", 'q"uote', "back\\slash", "new\nline", "tab\t", "é", "日本",
          "", 1, 1.5, -2, None, True, {"k": [1, "v"]}, ["x", 2]]


def ends(vocab: Llama, fmt: ResponseFormat, text: str) -> bool:
    """Whether the grammar holds ``text`` whole: every token of it in turn, and
    then the end of the answer."""
    tokens = vocab.tokenize(text.encode(), add_bos=False, special=False)
    checked_prefix(vocab._model.vocab, fmt, tokens)  # raises if a token leaves the grammar
    sampler = grammar_sampler(vocab._model.vocab, fmt)
    try:
        for token in tokens:
            llama_cpp.llama_sampler_accept(sampler, token)
        data = (llama_cpp.llama_token_data * 1)()
        entry = cast(Any, data[0])
        entry.id, entry.logit, entry.p = vocab.token_eos(), 0.0, 0.0
        candidates = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1,
                                                      sorted=False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
        return not math.isinf(entry.logit)
    finally:
        llama_cpp.llama_sampler_free(sampler)


def test_the_grammar_holds_each_values_json_text_exactly(vocab: Llama) -> None:
    fmt = ResponseFormat(type="json_schema", name="v", schema=json.dumps({"enum": TRICKY}),
                         strict=True)
    for value in TRICKY:
        text = json.dumps(value)
        assert ends(vocab, fmt, text), text
        assert violation(fmt, text) is None
    assert not ends(vocab, fmt, '"a')  # a value's beginning is not a value
    for outside in ('"b"', '"new\nline"', '"q"uote"', "2", '"abcd', '"ab"1'):
        with pytest.raises(EngineError):
            ends(vocab, fmt, outside)

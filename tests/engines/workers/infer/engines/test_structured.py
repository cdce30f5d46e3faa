"""Structured outputs on both llama.cpp engines with the real SmolLM2-135M GGUF:
a json_object answer is a JSON object, a strict json_schema answer (nested,
with $defs, as the openai client's ``parse`` sends it) is valid against its
schema, and an answer cut in the middle and continued by another run is
valid whole; a continuation the grammar does not allow is an EngineError, not
a crashed process."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from conveyor.errors import EngineError
from schemas.records import ResponseFormat
from workers.infer.engines.base import Engine, GenerationRequest

# what openai's parse() sends for: class City(BaseModel): name: str; country: str;
# population: int — and class Answer(BaseModel): cities: list[City]; note: str, each
# bounded (Field(max_length=...)): a 135M model held to a grammar can fill an
# unbounded string up to max_tokens
SCHEMA: dict[str, Any] = {
    "$defs": {"City": {
        "additionalProperties": False,
        "properties": {"name": {"title": "Name", "type": "string", "maxLength": 24},
                       "country": {"title": "Country", "type": "string", "maxLength": 16},
                       "population": {"title": "Population", "type": "integer"}},
        "required": ["name", "country", "population"], "title": "City", "type": "object"}},
    "additionalProperties": False,
    "properties": {"cities": {"items": {"$ref": "#/$defs/City"}, "title": "Cities",
                              "type": "array", "maxItems": 3},
                   "note": {"title": "Note", "type": "string", "maxLength": 40}},
    "required": ["cities", "note"], "title": "Answer", "type": "object"}
STRICT = ResponseFormat(type="json_schema", name="Answer", schema=json.dumps(SCHEMA),
                        strict=True)
OBJECT = ResponseFormat(type="json_object", name="", schema="", strict=False)
QUESTION = "List two big cities of France as JSON."


@pytest.fixture
def engine(llama_engine: Engine) -> Engine:
    return llama_engine  # each llama.cpp engine (conftest.py)


def ask(fmt: ResponseFormat, **overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "request_id": "r1", "kind": "chat", "model": "smollm2-135m-instruct",
        "max_tokens": 300, "temperature": 0.0, "response_format": fmt,
        "messages": ({"role": "user", "content": QUESTION},)}
    fields.update(overrides)
    return GenerationRequest(**fields)


async def answer(engine: Engine, req: GenerationRequest) -> tuple[str, str | None]:
    pieces = [p async for p in engine.generate(req)]
    return "".join(p.text for p in pieces), pieces[-1].finish_reason


async def test_json_object_is_an_object(engine: Engine) -> None:
    text, finish = await answer(engine, ask(OBJECT))
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict), text


async def test_a_strict_schema_answer_is_valid_against_it(engine: Engine) -> None:
    text, finish = await answer(engine, ask(STRICT))
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_an_answer_cut_in_the_middle_is_continued_into_a_valid_one(
        engine: Engine) -> None:
    whole, _ = await answer(engine, ask(STRICT, temperature=0.8, seed=7))
    cut = whole[:len(whole) // 2]
    rest, finish = await answer(engine, ask(STRICT, temperature=0.8, seed=11,
                                            continuation=cut))
    assert finish == "stop", cut + rest
    jsonschema.validate(json.loads(cut + rest), SCHEMA)


async def test_a_continuation_outside_the_grammar_is_an_engine_error(engine: Engine) -> None:
    with pytest.raises(EngineError, match="response_format"):
        await answer(engine, ask(STRICT, continuation="Sure! Here is"))
    text, _ = await answer(engine, ask(OBJECT))  # and the engine serves on
    assert isinstance(json.loads(text), dict)

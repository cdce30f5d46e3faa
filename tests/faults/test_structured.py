"""Structured outputs through a real Conveyor on the real model (llama.cpp, two
workers of one context each), asked with the unmodified ``openai`` client:
``parse`` with a nested Pydantic model, a streamed json_schema answer, a
json_object answer, a batch whose lines ask for a schema; a schema Conveyor
cannot hold an answer to is a 400 naming it, and an engine that cannot
constrain (the scripted one) refuses instead of ignoring the format (or the
tools). A worker
SIGKILLed in the middle of a structured answer leaves one valid answer: the
other worker continues it inside the same grammar."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.faults.test_delivery import assert_continued_elsewhere, kill_its_worker
from tests.pipeline.test_batches import line, lines_of, upload, wait
from tests.support.pipeline import Pipeline, client

QUESTION = "Name two big cities of France, with their population, as JSON."


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int


class Cities(BaseModel):
    cities: list[City] = Field(max_length=3)
    note: str = Field(max_length=40)


# an answer long enough to be killed in the middle of: up to 12 cities
LONG_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["cities"],
    "properties": {"cities": {"type": "array", "minItems": 8, "maxItems": 12, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "country"],
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "country": {"type": "string", "maxLength": 12}}}}}}


@pytest.fixture
def p(model_workers: Pipeline) -> Pipeline:
    return model_workers  # two workers of the real model (tests/conftest.py)


def structured_line(custom_id: str, content: str, max_tokens: int,
                    response_format: Any) -> dict[str, Any]:
    made = line(custom_id, content, max_tokens=max_tokens)
    made["body"]["response_format"] = response_format
    return made



def test_parse_with_a_nested_pydantic_model(p: Pipeline) -> None:
    done = client(p).chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}],
        response_format=Cities, temperature=0, max_tokens=200)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    parsed = choice.message.parsed
    assert isinstance(parsed, Cities) and parsed.cities, choice.message.content
    assert all(isinstance(c, City) for c in parsed.cities)


def test_responses_parse_with_a_nested_pydantic_model(p: Pipeline) -> None:
    done = client(p).responses.parse(model="smollm2", input=QUESTION, text_format=Cities,
                                     temperature=0, max_output_tokens=200)
    assert done.status == "completed", done
    assert isinstance(done.output_parsed, Cities) and done.output_parsed.cities, done
    assert done.text.format is not None and done.text.format.type == "json_schema"


def test_a_streamed_schema_answer_is_valid_whole(p: Pipeline) -> None:
    stream = client(p).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], stream=True,
        max_tokens=200, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {
            "name": "cities", "strict": True, "schema": Cities.model_json_schema()}})
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and len(parts) > 3
    Cities.model_validate_json("".join(parts))


# greedy SmolLM2 closes this object within 150 tokens on the batching llama.cpp engine
# ("Describe Paris in JSON." runs on with keys until max_tokens)
CITY_JSON = "Return a JSON object with the keys city and country for Paris."


def test_json_object_is_an_object(p: Pipeline) -> None:
    done = client(p).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CITY_JSON}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


def test_batch_lines_keep_their_formats(p: Pipeline) -> None:
    c = client(p)
    schema = {"name": "cities", "strict": True, "schema": Cities.model_json_schema()}
    lines = [structured_line("schema", QUESTION, 200,
                             {"type": "json_schema", "json_schema": schema}),
             structured_line("object", CITY_JSON, 150, {"type": "json_object"})]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/chat/completions",
                             completion_window="24h")
    done = wait(c, batch.id, timeout=300)
    assert done.status == "completed", done
    out = {o["custom_id"]: o["response"]["body"] for o in lines_of(c, done.output_file_id)}
    Cities.model_validate_json(out["schema"]["choices"][0]["message"]["content"])
    described = out["object"]["choices"][0]
    assert described["finish_reason"] == "stop", described
    assert isinstance(json.loads(described["message"]["content"]), dict), described


def test_a_batch_with_a_schema_that_cannot_be_held_to_fails_naming_its_line(
        p: Pipeline) -> None:
    c = client(p)
    lines = [structured_line("fine", QUESTION, 5, {"type": "json_object"}),
             structured_line("bad", QUESTION, 5, {"type": "json_schema", "json_schema": {
                 "name": "bad", "schema": {"type": "strin"}}})]
    batch = c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/chat/completions",
                             completion_window="24h")
    done = wait(c, batch.id, timeout=60)
    assert done.status == "failed" and done.errors and done.errors.data, done
    [error] = done.errors.data
    assert error.line == 2 and error.param == "body.response_format.json_schema.schema", error


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "pattern": "[a-z]+"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
     "response_format.json_schema.name"),
])
def test_a_schema_that_cannot_be_held_to_is_a_400_naming_it(p: Pipeline, fmt: Any,
                                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(p).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}],
            response_format=fmt, max_tokens=5)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


@pytest.mark.parametrize(("asked", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "now"}}]}, "tools"),
])
def test_an_engine_that_cannot_constrain_refuses(pipeline: Pipeline, asked: dict[str, Any],
                                                 param: str) -> None:
    """The session's pipeline runs the scripted engine, which holds text to
    nothing and writes no calls."""
    with pytest.raises(openai.BadRequestError) as info:
        client(pipeline).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            **asked)
    body: Any = info.value.body
    assert body["param"] == param and "scripted" in body["message"], body


def test_a_worker_killed_mid_answer_leaves_one_valid_answer(p: Pipeline) -> None:
    c = client(p)
    killed: list[str] = []
    stream = c.chat.completions.create(
        model="smollm2", stream=True, max_tokens=400, temperature=0.7, seed=5,
        messages=[{"role": "user", "content": "List twelve cities of Europe as JSON."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "cities", "strict": True, "schema": LONG_SCHEMA}})
    parts: list[str] = []
    request_id, finish = "", None
    for chunk in stream:
        request_id = request_id or chunk.id.removeprefix("chatcmpl-")
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if len(parts) == 8 and not killed:  # well inside the array
            kill_its_worker(p, request_id, killed)
    text = "".join(parts)
    assert killed and finish == "stop", text
    jsonschema.validate(json.loads(text), LONG_SCHEMA)
    assert_continued_elsewhere(p, request_id, killed)

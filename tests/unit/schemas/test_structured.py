"""response_format at the API (schemas/openai/requests.py) and its checks
(schemas/structured.py): what is carried, what is refused and with which
param, and what an answer is checked against."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.errors import InvalidRequest
from schemas.answer_format import grammar_of, violation
from schemas.openai.generations import chat_generation
from schemas.openai.requests import ChatCompletionRequest
from schemas.records import ResponseFormat
from schemas.structured import check_format, wire_format

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0},
                                          "label": {"type": "string"}},
         "required": ["x", "label"]}


def chat(response_format: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
        "response_format": response_format})


def fmt_of(response_format: Any) -> ResponseFormat | None:
    return chat_generation(chat(response_format)).get("response_format")


def schema_format(schema: Any, strict: bool = True) -> ResponseFormat:
    return ResponseFormat(type="json_schema", name="point", schema=json.dumps(schema),
                          strict=strict)


def test_text_carries_nothing_and_json_object_its_type() -> None:
    assert fmt_of({"type": "text"}) is None
    assert fmt_of({"type": "json_object"}) == ResponseFormat(
        type="json_object", name="", schema="", strict=False)


def test_a_json_schema_is_carried_as_the_client_sent_it() -> None:
    fmt = fmt_of({"type": "json_schema", "json_schema": {
        "name": "point", "description": "a point", "schema": POINT, "strict": True}})
    assert fmt is not None
    assert (fmt["type"], fmt["name"], fmt["strict"]) == ("json_schema", "point", True)
    assert json.loads(fmt["schema"]) == POINT
    assert wire_format(fmt) == {"type": "json_schema", "json_schema": {
        "name": "point", "schema": POINT, "strict": True}}


def test_a_schema_left_out_allows_any_json() -> None:
    fmt = fmt_of({"type": "json_schema", "json_schema": {"name": "any"}})
    assert fmt is not None and json.loads(fmt["schema"]) == {}
    assert violation(fmt, "[1, 2]") is None


@pytest.mark.parametrize(("response_format", "loc"), [
    ({"type": "xml"}, ("response_format", "type")),
    ({"type": "json_schema"}, ("response_format",)),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": POINT}},
     ("response_format", "json_schema", "name")),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65}},
     ("response_format", "json_schema", "name")),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": "not an object"}},
     ("response_format", "json_schema", "schema")),
])
def test_malformed_formats_are_refused_at_their_field(response_format: Any,
                                                      loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        chat(response_format)
    assert {e["loc"][:len(loc)] for e in info.value.errors()} == {loc}


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "strin"}, "type"),  # not a JSON Schema: the meta-schema says where
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "Missing"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ({"type": "string", "pattern": "[a-z]+"}, "Pattern"),  # a JSON Schema, not compilable
    ({"not": {"type": "string"}}, "Unrecognized"),
])
def test_a_schema_that_cannot_be_held_to_is_a_400_naming_it(schema: Any, says: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        fmt_of({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert info.value.param == "response_format.json_schema.schema"
    assert info.value.status == 400 and says in info.value.message


def test_objects_take_no_property_they_do_not_name() -> None:
    grammar = grammar_of(schema_format(POINT, strict=False))
    assert "x-kv" in grammar and "label-kv" in grammar
    check_format(schema_format(POINT))


def test_an_answer_is_checked_against_what_the_grammar_cannot_hold() -> None:
    fmt = schema_format(POINT)
    assert violation(fmt, '{"x": 3, "label": "a"}') is None
    assert "minimum" in (violation(fmt, '{"x": -3, "label": "a"}') or "")
    assert "x" in (violation(fmt, '{"x": -3, "label": "a"}') or "")
    assert "not JSON" in (violation(fmt, '{"x": 3, "lab') or "")
    obj = ResponseFormat(type="json_object", name="", schema="", strict=False)
    assert violation(obj, "{}") is None
    assert violation(obj, "[1]") == "the answer is not a JSON object"


def test_strings_take_no_raw_control_character() -> None:
    """JSON escapes them: a raw newline inside a string does not parse."""
    [chars] = [rule for rule in grammar_of(schema_format(POINT)).splitlines()
               if rule.startswith("char ::= ")]
    assert "\\x00-\\x1F" in chars, chars


@pytest.mark.parametrize(("fmt", "says"), [
    (ResponseFormat(type="json_schema", name="p", schema="{not json", strict=True), "not JSON"),
    (ResponseFormat(type="xml", name="", schema="", strict=False),  # type: ignore[typeddict-item]
     "Unknown"),
])
def test_a_format_no_api_would_send_is_refused_too(fmt: ResponseFormat, says: str) -> None:
    """What the infer worker checks again: an event in the log may be forged."""
    with pytest.raises(InvalidRequest) as info:
        check_format(fmt, param="response_format")
    assert info.value.param == "response_format" and says in info.value.message

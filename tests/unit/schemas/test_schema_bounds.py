"""Conveyor's bounds on a schema (schemas/structured.py): each is a 400 naming
the parameter and the bound, on every path a schema arrives by (chat's
response_format, its tools, the Responses API's text.format and tools, an
event checked again in the worker), and nothing a client sends makes a
checker or the compiler raise anything else. Then the grammar an enum
compiles to: a trie, whose every rule is as wide as its branches, not one
alternative per value."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conveyor.errors import InvalidRequest
from schemas.answer_format import grammar_of, violation
from schemas.openai.generations import chat_generation
from schemas.openai.requests import ChatCompletionRequest, param_of
from schemas.openai.responses import parse_request
from schemas.records import Function, ResponseFormat, Tools
from schemas.structured import (
    MAX_ALTERNATIVES,
    MAX_ENUM_VALUES,
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_NESTING,
    MAX_GRAMMAR_REPEAT,
    MAX_OBJECT_PROPERTIES,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    check_format,
    grammar_fault,
    literal_trie,
    schema_bounds_fault,
)
from schemas.tools import check_tools, tool_format

SCHEMA_PARAM = "response_format.json_schema.schema"


def nested(levels: int) -> dict[str, Any]:
    """A schema ``levels`` deep: objects in objects, a string innermost."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"],
                  "additionalProperties": False}
    return schema


def enum_of(values: int) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["pick"],
            "properties": {"pick": {"enum": [f"item-{i:05d}" for i in range(values)]}}}


def chat_format(schema: Any) -> ResponseFormat | None:
    body = ChatCompletionRequest.model_validate({
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "s", "schema": schema}}})
    return chat_generation(body).get("response_format")


def refused_format(schema: Any) -> str:
    with pytest.raises(InvalidRequest) as info:
        chat_format(schema)
    assert info.value.status == 400 and info.value.param == SCHEMA_PARAM, info.value.message
    return info.value.message


def schema_format(schema: Any) -> ResponseFormat:
    return ResponseFormat(type="json_schema", name="s", schema=json.dumps(schema), strict=True)


# -- each bound ---------------------------------------------------------------------------


def test_a_schema_nested_100_levels_is_a_400_naming_the_bound() -> None:
    message = refused_format(nested(100))
    assert "nested 100 levels deep" in message
    assert f"at most {MAX_SCHEMA_DEPTH} are allowed" in message


def test_a_schema_at_the_depth_bound_is_checked_compiled_and_its_answers_checked() -> None:
    fmt = chat_format(nested(MAX_SCHEMA_DEPTH))
    assert fmt is not None and grammar_fault(grammar_of(fmt)) is None
    answer = '{"a": ' * (MAX_SCHEMA_DEPTH - 1) + '"x"' + "}" * (MAX_SCHEMA_DEPTH - 1)
    assert violation(fmt, answer) is None
    assert "does not match" in (violation(fmt, answer.replace('"x"', "1")) or "")
    assert "nested" in refused_format(nested(MAX_SCHEMA_DEPTH + 1))


def test_depth_counts_through_refs_arrays_unions_and_values() -> None:
    chain: dict[str, Any] = {
        "$defs": {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                  for i in range(MAX_SCHEMA_DEPTH)},
        "$ref": "#/$defs/d0"}
    chain["$defs"][f"d{MAX_SCHEMA_DEPTH}"] = {"type": "integer"}
    assert "levels deep" in (schema_bounds_fault(chain) or "")
    unions: dict[str, Any] = {"type": "null"}
    for _ in range(MAX_SCHEMA_DEPTH):
        unions = {"anyOf": [unions, {"type": "integer"}]}
    assert "levels deep" in (schema_bounds_fault(unions) or "")
    value: Any = 1
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        value = [value]
    assert "levels deep" in (schema_bounds_fault({"const": value}) or "")
    # a schema that refers to itself is a recursion of the grammar, not depth
    tree = {"type": "object", "properties": {"children": {"type": "array",
                                                          "items": {"$ref": "#"}}}}
    assert schema_bounds_fault(tree) is None


def test_a_schema_nested_past_what_json_can_encode_is_a_400_not_a_recursion_error() -> None:
    assert "nested 5,000 levels deep" in refused_format(nested(5_000))


def test_an_enum_of_10000_strings_is_served_and_of_10001_refused() -> None:
    fmt = chat_format(enum_of(MAX_ENUM_VALUES))
    assert fmt is not None and grammar_fault(grammar_of(fmt)) is None
    message = refused_format(enum_of(MAX_ENUM_VALUES + 1))
    assert f"10,001 enum values in all; at most {MAX_ENUM_VALUES:,} are allowed" in message


def test_enum_values_count_over_the_whole_schema() -> None:
    half = MAX_ENUM_VALUES // 2 + 1
    two = {"type": "object", "properties": {
        "a": {"enum": list(range(half))}, "b": {"enum": list(range(half))}}}
    assert "enum values in all" in (schema_bounds_fault(two) or "")


def test_a_union_wider_than_the_bound_is_refused_unless_it_is_of_constants() -> None:
    """Every alternative of a union stays open in llama.cpp's sampler until the
    answer tells them apart, and each costs its share of every token."""
    wide: dict[str, Any] = {"type": "array", "items": {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(MAX_ALTERNATIVES + 1)]}}
    message = refused_format(wide)
    assert f"of {MAX_ALTERNATIVES + 1} alternatives; at most {MAX_ALTERNATIVES}" in message
    wide["items"]["anyOf"].pop()
    assert chat_format(wide) is not None
    constants: dict[str, Any] = {"anyOf": [{"const": f"c{i}"} for i in range(MAX_ENUM_VALUES)]}
    assert schema_bounds_fault(constants) is None  # compiled as an enum: a trie
    constants["anyOf"].append({"const": "one more"})
    assert "enum values in all" in (schema_bounds_fault(constants) or "")


def test_an_object_of_more_optional_properties_than_the_bound_is_refused() -> None:
    """Any optional property may come next, so each is an alternative too (and
    the compiler nests a rule per optional property: a RecursionError past 900)."""
    def of(optional: int) -> dict[str, Any]:
        properties = {f"p{i}": {"type": "integer"} for i in range(optional + 10)}
        return {"type": "object", "properties": properties, "required": list(properties)[:10]}

    message = refused_format(of(MAX_ALTERNATIVES + 1))
    assert f"{MAX_ALTERNATIVES + 1} optional properties; at most {MAX_ALTERNATIVES}" in message
    assert chat_format(of(MAX_ALTERNATIVES)) is not None
    assert "optional properties" in refused_format(of(1_000))


def test_too_many_properties_are_refused() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                             for i in range(MAX_OBJECT_PROPERTIES + 1)}}
    assert f"at most {MAX_OBJECT_PROPERTIES:,}" in refused_format(wide)


def test_names_and_values_past_the_character_bound_are_refused() -> None:
    long = {"type": "object", "properties": {"a": {"enum": ["x" * 1_000] * 121}}}
    message = refused_format(long)
    assert "121,001 characters" in message and f"at most {MAX_SCHEMA_CHARS:,}" in message


# -- what used to reach the engine and fail there -------------------------------------


def test_long_strings_and_arrays_are_left_to_the_answers_check() -> None:
    """A maxLength of 100,000 compiled to 100,000 nested groups, which crashed
    llama.cpp's grammar parser (SIGSEGV) in the worker; above the repeat bound
    it is checked on the answer instead."""
    for schema in ({"type": "string", "maxLength": 100_000},
                   {"type": "string", "minLength": 5_000},
                   {"type": "array", "items": {"type": "integer"}, "maxItems": 10_000}):
        fmt = chat_format(schema)
        assert fmt is not None
        grammar = grammar_of(fmt)
        assert len(grammar) < 1_000 and grammar_fault(grammar) is None
    fmt = chat_format({"type": "string", "maxLength": MAX_GRAMMAR_REPEAT + 1})
    assert fmt is not None
    assert violation(fmt, json.dumps("x" * (MAX_GRAMMAR_REPEAT + 2)))
    held = chat_format({"type": "string", "maxLength": MAX_GRAMMAR_REPEAT})
    assert held is not None and grammar_fault(grammar_of(held)) is None


@pytest.mark.parametrize(("pattern", "says"), [
    ("^[a-z]{1,50000}$", "nests 49,999 groups deep"),  # the same nesting, from a pattern
    ("(" * 3_000 + "a" + ")" * 3_000, "a pattern"),  # past the regex parser's recursion
])
def test_a_pattern_that_cannot_be_compiled_safely_is_refused(pattern: str, says: str) -> None:
    assert says in refused_format({"type": "string", "pattern": pattern})


def test_what_llama_cpp_cannot_parse_is_refused_at_the_api() -> None:
    """A definition that is nothing but itself compiles to a left-recursive
    rule, which llama.cpp refuses: a 400 here, not an EngineError in the worker."""
    itself = {"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}},
              "$defs": {"loop": {"anyOf": [{"$ref": "#/$defs/loop"}, {"type": "null"}]}}}
    assert "llama.cpp cannot parse" in refused_format(itself)


def test_the_grammar_bounds() -> None:
    assert grammar_fault('root ::= "a"\n') is None
    big = "root ::= " + '"a" ' * (MAX_GRAMMAR_CHARS // 4 + 1)
    assert f"at most {MAX_GRAMMAR_CHARS:,}" in (grammar_fault(big) or "")
    deep = "root ::= " + '("a" ' * (MAX_GRAMMAR_NESTING + 1) + ")?" * (MAX_GRAMMAR_NESTING + 1)
    assert f"at most {MAX_GRAMMAR_NESTING:,}" in (grammar_fault(deep) or "")
    # parentheses inside literals and character classes are not groups
    assert grammar_fault('root ::= "((((" [()] ")"\n') is None
    assert "cannot parse" in (grammar_fault("root ::= (\n") or "")


def test_an_answer_nested_past_the_parser_is_a_violation_not_an_exception() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    obj = ResponseFormat(type="json_object", name="", schema="", strict=False)
    assert "nested too deeply" in (violation(obj, deep) or "")
    recursive = schema_format({"type": "array", "items": {"$ref": "#"}})
    assert "nested too deeply" in (violation(recursive, "[" * 900 + "]" * 900) or "")
    tools = tool_format(Tools(functions=[Function(name="f", description="", parameters="",
                                                  strict=False)],
                              choice="auto", function="", parallel=True))
    call = '<tool_call>\n{"name": "f", "arguments": {"a": ' + deep + "}}\n</tool_call>"
    assert "nested too deeply" in (violation(tools, call) or "")


KEYWORDS = st.sampled_from([
    "type", "properties", "items", "anyOf", "oneOf", "allOf", "enum", "const", "$ref", "$defs",
    "required", "additionalProperties", "minLength", "maxLength", "minItems", "maxItems",
    "pattern", "format", "prefixItems", "not", "minimum", "patternProperties", "if", "then"])
SCALARS = (st.none() | st.booleans() | st.integers(-5, 3_000) | st.text(max_size=4)
           | st.sampled_from(["object", "string", "integer", "array", "number", "null", "#",
                              "#/$defs/a", "#/properties/a", "^a+$", "date", "uuid", "a{2,4}"]))
SCHEMAS = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    KEYWORDS | st.sampled_from(["a", "b"]), inner, max_size=5), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(SCHEMAS)
def test_any_schema_is_served_or_a_400_and_nothing_else(schema: Any) -> None:
    """Whatever JSON a client sends as a schema, the checks and the compiler
    either take it (and then its grammar compiles and answers are checked) or
    refuse it with a 400: no other exception."""
    fmt = schema_format(schema)
    try:
        check_format(fmt)
    except InvalidRequest:
        return
    grammar_of(fmt)
    for answer in ("{}", '"a"', "[1", "null"):
        violation(fmt, answer)


# -- every path a schema arrives by ---------------------------------------------------------


def test_tools_parameters_past_a_bound_name_the_function_parameter() -> None:
    def chat(parameters: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "ok"}},
                      {"type": "function", "function": {"name": "f",
                                                        "parameters": parameters}}]})

    with pytest.raises(ValidationError) as info:
        chat(nested(100))
    [error] = info.value.errors()
    assert param_of(error["loc"]) == "tools[1].function.parameters"
    assert "nested 100 levels deep" in error["msg"] and "at most 64" in error["msg"]
    with pytest.raises(ValidationError):
        chat(nested(5_000))  # refused before anything encodes it
    with pytest.raises(ValidationError) as info:
        chat(enum_of(MAX_ENUM_VALUES + 1))
    assert "enum values" in info.value.errors()[0]["msg"]
    assert chat_generation(chat(enum_of(MAX_ENUM_VALUES)))["tools"] is not None


def test_a_forged_event_past_a_bound_is_refused_where_the_worker_checks_it() -> None:
    deep = json.dumps(nested(100))
    with pytest.raises(InvalidRequest) as info:
        check_format(ResponseFormat(type="json_schema", name="s", schema=deep, strict=True),
                     param="response_format")
    assert info.value.param == "response_format" and "nested 100" in info.value.message
    tools = Tools(functions=[Function(name="f", description="", parameters=deep,
                                      strict=False)],
                  choice="auto", function="", parallel=True)
    with pytest.raises(InvalidRequest) as info:
        check_tools(tools)
    assert info.value.param == "tools[0].function.parameters"
    text = "[" * 100_000 + "]" * 100_000  # past what json.loads reads
    with pytest.raises(InvalidRequest) as info:
        check_format(ResponseFormat(type="json_schema", name="s", schema=text, strict=True))
    assert "nested more than" in info.value.message
    not_an_object = Tools(functions=[Function(name="f", description="", parameters="true",
                                              strict=False)],
                          choice="auto", function="", parallel=True)
    with pytest.raises(InvalidRequest):
        check_tools(not_an_object)


def test_the_responses_api_names_its_own_parameters() -> None:
    def parse(**body: Any) -> Any:
        return parse_request(json.dumps({"model": "smollm2", "input": "Hi", **body}).encode())

    body = parse(text={"format": {"type": "json_schema", "name": "s", "schema": nested(100)}})
    with pytest.raises(InvalidRequest) as info:
        body.text.format.record()
    assert info.value.param == "text.format.schema" and "at most 64" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        parse(tools=[{"type": "function", "name": "f", "parameters": nested(100)}])
    assert info.value.param == "tools[0].parameters" and "at most 64" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        parse(tools=[{"type": "function", "name": "f",
                      "parameters": enum_of(MAX_ENUM_VALUES + 1)}])
    assert info.value.param == "tools[0].parameters" and "enum values" in info.value.message
    with pytest.raises(InvalidRequest) as info:  # past what json.loads reads: a 400
        parse_request(b'{"model": "smollm2", "input": ' + b"[" * 100_000 + b"]" * 100_000
                      + b"}")
    assert "nested too deeply" in info.value.message


# -- an enum's grammar -------------------------------------------------------------------


def words(trie: list[tuple[bool, list[tuple[str, int | None]]]]) -> set[str]:
    """Every text the trie holds, read back from its nodes."""
    out: set[str] = set()
    stack = [(0, "")]
    while stack:
        node, prefix = stack.pop()
        ends_here, branches = trie[node]
        if ends_here:
            out.add(prefix)
        for chars, child in branches:
            if child is None:
                out.add(prefix + chars)
            else:
                stack.append((child, prefix + chars))
    return out


def test_a_trie_holds_exactly_its_texts_and_branches_where_they_part() -> None:
    rng = random.Random(7)
    for _ in range(200):
        texts = ["".join(rng.choice('ab"\\') for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 30))]
        trie = literal_trie(texts)
        assert words(trie) == set(texts)
        for ends_here, branches in trie:
            firsts = [chars[0] for chars, _ in branches]
            assert len(firsts) == len(set(firsts)) and all(firsts)
            assert ends_here or len(branches) >= 2 or trie[0] == (ends_here, branches)


def alternatives(grammar: str) -> int:
    """The widest rule's alternatives: how many alternatives llama.cpp's sampler
    holds open at once at most, from token to token."""
    atoms = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')
    return max(atoms.sub("", line).count("|") + 1 for line in grammar.splitlines() if line)


def test_an_enum_of_10000_compiles_to_rules_as_wide_as_the_digits_not_10000() -> None:
    """What each token costs: a flat alternation kept every value open (10,000
    alternatives at each step, a second of the grammar's work a token); a trie
    keeps one alternative per branch."""
    assert alternatives(grammar_of(schema_format(enum_of(MAX_ENUM_VALUES)))) <= 12
    spread = [f"{random.Random(i).getrandbits(40):010x}" for i in range(MAX_ENUM_VALUES)]
    grammar = grammar_of(schema_format({"enum": spread}))
    assert alternatives(grammar) <= 17 and grammar_fault(grammar) is None


def test_a_union_of_constants_compiles_to_one_trie() -> None:
    union = {"anyOf": [{"const": f"v{i}"} for i in range(500)] + [{"enum": ["w", "x"]}]}
    grammar = grammar_of(schema_format(union))
    assert alternatives(grammar) <= 11 and grammar_fault(grammar) is None
    assert violation(schema_format(union), '"v499"') is None


def test_enum_values_of_every_json_type_and_escape_compile() -> None:
    values = ["a", "ab", 'q"uote', "back\\slash", "é", "\n", 1, 1.5, None, True,
              {"k": [1, "v"]}, ["x"]]
    grammar = grammar_of(schema_format({"enum": values}))
    assert grammar_fault(grammar) is None  # which texts it holds: tests/engines, on llama.cpp

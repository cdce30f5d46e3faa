"""The Responses API request: what is served, what is refused and how it is named."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.errors import InvalidRequest
from schemas.openai.requests import param_of
from schemas.openai.responses import ResponsesRequest, field_names, parse_request


def parse(**body: Any) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "smollm2", "input": "Hi", **body}).encode())


def refused(param: str | None, **body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    return info.value


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert turns(parse()) == [("user", "Hi")]
    assert turns(parse(instructions="Be brief.")) == [("system", "Be brief."), ("user", "Hi")]


def turns(body: ResponsesRequest) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in body.messages()]


def test_message_items_of_every_role_with_text_parts() -> None:
    body = parse(instructions="Rules.", input=[
        {"role": "developer", "content": "Dev."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c",
                                           "annotations": []}]},
        {"role": "system", "content": "Sys."},
    ])
    assert turns(body) == [("system", "Rules."), ("developer", "Dev."), ("user", "ab"),
                           ("assistant", "c"), ("system", "Sys.")]


def test_function_calls_and_their_outputs_are_turns_of_the_conversation() -> None:
    body = parse(tools=[{"type": "function", "name": "get_weather"}], input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_a", "status": "completed"},
        {"type": "function_call", "call_id": "b", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "a", "output": "18 C"},
        {"type": "function_call_output", "call_id": "b",
         "output": [{"type": "input_text", "text": "21 C"}]}])
    messages = body.messages()
    assert [(m["role"], m["content"], m["tool_call_id"]) for m in messages] == [
        ("user", "Weather in Paris and Rome?", None), ("assistant", "", None),
        ("tool", "18 C", "a"), ("tool", "21 C", "b")]
    assert messages[1]["tool_calls"] == [
        {"id": "a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": "b", "name": "get_weather", "arguments": '{"city": "Rome"}'}]
    tools = body.tools_record()
    assert tools is not None and tools["choice"] == "auto" and tools["parallel"]
    assert body.reads_calls()
    assert not parse(tools=[{"type": "function", "name": "f"}], tool_choice="none").reads_calls()


def test_function_tools_that_cannot_be_served_name_their_parameter() -> None:
    bad = parse(tools=[{"type": "function", "name": "f", "parameters": {"type": "strin"}}])
    with pytest.raises(InvalidRequest) as info:
        bad.tools_record()
    assert info.value.param == "tools[0].parameters"
    named = parse(tools=[{"type": "function", "name": "f"}],
                  tool_choice={"type": "function", "name": "g"})
    with pytest.raises(InvalidRequest) as info:
        named.tools_record()
    assert info.value.param == "tool_choice"
    with_format = parse(tools=[{"type": "function", "name": "f"}],
                        text={"format": {"type": "json_object"}})
    with pytest.raises(InvalidRequest) as info:
        with_format.tools_record()
    assert info.value.param == "text.format"


def test_what_the_client_may_send_and_changes_nothing_is_accepted() -> None:
    body = parse(max_output_tokens=16, temperature=0, top_p=0.5, stream=True, store=True,
                 metadata={"k": "v"}, user="u", safety_identifier="s", prompt_cache_key="p",
                 service_tier="auto", stream_options={"include_obfuscation": False},
                 text={"format": {"type": "text"}}, truncation="disabled",
                 tool_choice="auto", parallel_tool_calls=False, tools=[], include=[],
                 top_logprobs=0, reasoning=None, unknown_vendor_field=1)
    assert body.max_output_tokens == 16 and body.temperature == 0 and body.stream
    assert parse(tool_choice="none").tool_choice == "none"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "two words"}]}, "tools[0].name"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "a b"}}}, "text.format.name"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
])
def test_what_cannot_be_honoured_is_refused_by_name(extra: dict[str, Any], param: str) -> None:
    refused(param, **extra)


@pytest.mark.parametrize(("extra", "param"), [
    ({"model": ""}, "model"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "role": "user", "content": "x"}]},
     "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "detail": "ultra"}]}]},
     "input[0].content[0].detail"),
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]},
     "input[1].content"),
    ({"instructions": "\udfff"}, "instructions"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2**31}, "max_output_tokens"),
    ({"max_output_tokens": 1.5}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
def test_invalid_values_are_refused_by_name(extra: dict[str, Any], param: str) -> None:
    refused(param, **extra)


def test_a_lone_surrogate_is_refused_with_a_message_that_says_so() -> None:
    error = refused("input", input="a\ud800")
    assert "lone surrogate" in error.message


def test_background_must_be_stored() -> None:
    assert parse(background=True).background
    assert parse(background=True, store=True).store
    refused("store", background=True, store=False)


def test_bodies_that_are_not_a_json_object() -> None:
    for raw in (b"{", b"[1]", b"\xff\xfe", b'"text"'):
        with pytest.raises(InvalidRequest) as info:
            parse_request(raw)
        assert info.value.param is None and info.value.status == 400


def test_param_of_leaves_out_union_tags() -> None:
    names = field_names()
    assert param_of(("input", "list[InputMessage]", 2, "content", "str"), names) == (
        "input[2].content")
    assert param_of(("text", "format", "type"), names) == "text.format.type"
    assert param_of((), names) is None

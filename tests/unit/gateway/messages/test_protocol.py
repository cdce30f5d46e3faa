"""A Messages API request as the pipeline's chat generation, and its refusals
naming the field as Anthropic does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.errors import InvalidRequest
from gateway.messages.protocol import anthropic_param, generation_of, parse_request

BASE: dict[str, Any] = {"model": "smollm2", "max_tokens": 16,
                        "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = {"name": "get_weather", "description": "The weather.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def parsed(**fields: Any) -> Any:
    return parse_request(json.dumps({**BASE, **fields}).encode())


def refusal(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        generation_of(parse_request(json.dumps(body).encode()))
    return caught.value


def test_a_plain_request_is_a_chat_generation() -> None:
    mapped = generation_of(parsed(system="Be brief.", stop_sequences=["\n\n"],
                                  temperature=0.5, top_p=0.9, metadata={"user_id": "u1"},
                                  stream=True))
    g = mapped.generation
    assert g["kind"] == "chat" and g["api"] == "messages" and g["model"] == "smollm2"
    assert [(m["role"], m["content"]) for m in g["messages"]] == [
        ("system", "Be brief."), ("user", "Hi")]
    assert g["sampling"]["max_tokens"] == 16 and g["sampling"]["stop"] == ["\n\n"]
    assert g["sampling"]["temperature"] == 0.5 and g["sampling"]["top_p"] == 0.9
    assert g["metadata"] == {"user_id": "u1"} and g["stream"] is True
    assert g["tools"] is None and g["store"] is False
    assert mapped.origins == ["system", "messages.0"]


def test_defaults_are_anthropics() -> None:
    g = generation_of(parsed()).generation
    assert g["sampling"]["temperature"] == 1.0 and g["sampling"]["top_p"] == 1.0
    assert g["stream"] is False and g["metadata"] == {}


def test_system_blocks_and_text_blocks_join() -> None:
    g = generation_of(parsed(
        system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two.",
                                                   "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}])).generation
    assert [m["content"] for m in g["messages"]] == ["One.\n\nTwo.", "a\nb"]


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_turns() -> None:
    mapped = generation_of(parsed(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no such city"}]},
            {"type": "text", "text": "And tomorrow?"}]}]))
    turns = mapped.generation["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "tool", "user"]
    assert turns[1]["content"] == "Let me look."
    assert turns[1]["tool_calls"] == [{"id": "toolu_1", "name": "get_weather",
                                       "arguments": '{"city": "Paris"}'}]
    assert (turns[2]["tool_call_id"], turns[2]["content"]) == ("toolu_1", "18 C")
    assert (turns[3]["tool_call_id"], turns[3]["content"]) == ("toolu_2", "Error: no such city")
    assert turns[4]["content"] == "And tomorrow?"
    assert mapped.origins == ["messages.0", "messages.1", "messages.2", "messages.2",
                              "messages.2"]


@pytest.mark.parametrize(("choice", "expected"), [
    (None, ("auto", "", True)),
    ({"type": "auto"}, ("auto", "", True)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", "", False)),
    ({"type": "tool", "name": "get_weather"}, ("function", "get_weather", True)),
    ({"type": "none"}, ("none", "", True)),
])
def test_tool_choice_maps_onto_the_pipelines(choice: Any, expected: tuple[str, str, bool]
                                             ) -> None:
    extra = {"tool_choice": choice} if choice is not None else {}
    tools = generation_of(parsed(tools=[{**WEATHER, "strict": True}], **extra)).generation["tools"]
    assert tools is not None
    assert (tools["choice"], tools["function"], tools["parallel"]) == expected
    [function] = tools["functions"]
    assert function["name"] == "get_weather" and function["strict"] is True
    assert json.loads(function["parameters"]) == WEATHER["input_schema"]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"max_tokens": None}, "max_tokens", "Field required"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "user"),
    ({"messages": []}, "messages", "at least 1"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ({"top_k": 5}, "top_k", "not supported"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "not supported"),
    ({"output_config": {"effort": "low"}}, "output_config", "not supported"),
    ({"frequency_penalty": 1}, "frequency_penalty", "Extra inputs"),
    ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "messages.0.name",
     "Extra inputs"),
    ({"system": [{"type": "text", "text": "Be brief.", "lang": "en"}]}, "system.0.lang",
     "Extra inputs"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]},
     "messages.0.content.1", "image content blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0", "document"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
     "messages.0.content.0.type", "unsupported content block"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0", "assistant message"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {}}]}]}]},
     "messages.0.content.0.content.0", "text blocks only"),
    ({"messages": [{"role": "user", "content": "Pick A or B."},
                   {"role": "assistant", "content": "The answer is"}]}, "messages.1", "prefill"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type",
     "server tools"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema", "Field required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type", "one of"),
])
def test_refusals_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    body = {k: v for k, v in {**BASE, **fields}.items() if v is not None}
    exc = refusal(body)
    assert exc.status == 400 and exc.param == param, exc
    assert words in exc.message and exc.message.startswith(param), exc.message


def test_accepted_fields_without_effect() -> None:
    g = generation_of(parsed(service_tier="auto", cache_control={"type": "ephemeral"},
                             speed="standard", inference_geo="us",
                             diagnostics={"previous_message_id": "msg_1"})).generation
    assert g["kind"] == "chat"


def test_a_body_that_is_no_json_object() -> None:
    for raw in (b"{", b"[]"):
        with pytest.raises(InvalidRequest):
            parse_request(raw)


@pytest.mark.parametrize(("param", "origins", "expected"), [
    ("messages[2].content", ["system", "messages.0", "messages.1"], "messages.1.content"),
    ("messages[0]", ["system", "messages.0"], "system"),
    ("tools[1].parameters", None, "tools.1.parameters"),
    ("max_tokens", ["messages.0"], "max_tokens"),
    (None, None, None),
])
def test_pipeline_params_are_named_as_the_request_names_them(
        param: str | None, origins: list[str] | None, expected: str | None) -> None:
    assert anthropic_param(param, origins) == expected

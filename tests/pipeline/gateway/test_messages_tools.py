"""Tool use on Anthropic's Messages API through a real Conveyor on the real
model (llama.cpp, two workers of one context each), asked by the unmodified
``anthropic`` client: a call made as a ``tool_use`` block with ``stop_reason``
"tool_use", the same call streamed as ``input_json_delta`` events, and a round
trip that hands the tool's result back as a ``tool_result`` block. The tools
ride the pipeline's tool calling (schemas/tools.py, decision 0019)."""

from __future__ import annotations

from typing import Any

import anthropic
import jsonschema
import pytest

from tests.support.pipeline import Pipeline

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
WEATHER: dict[str, Any] = {"name": "get_weather", "description": "The current weather of a city.",
                           "input_schema": WEATHER_SCHEMA}
TIME: dict[str, Any] = {"name": "get_time", "description": "The time now in a time zone.",
                        "input_schema": {"type": "object", "required": ["zone"], "properties": {
                            "zone": {"type": "string", "maxLength": 30}}}}
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# the client has no temperature argument any more; the API still takes it
COLD = {"temperature": 0}
NAMED: dict[str, Any] = {"type": "tool", "name": "get_weather",
                         "disable_parallel_tool_use": True}


@pytest.fixture
def p(model_workers: Pipeline) -> Pipeline:
    return model_workers  # two workers of the real model (tests/conftest.py)


def claude(p: Pipeline) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=p.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def test_a_named_tool_is_called_with_input_that_fits_its_schema(p: Pipeline) -> None:
    m = claude(p).messages.create(model="smollm2", max_tokens=80, extra_body=COLD,
                                  messages=QUESTION, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert m.stop_reason == "tool_use", m
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)


def test_any_tool_must_be_called(p: Pipeline) -> None:
    m = claude(p).messages.create(model="smollm2", max_tokens=80, extra_body=COLD,
                                  messages=QUESTION, tools=[WEATHER, TIME],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    assert [b.name for b in m.content if b.type == "tool_use"][0] in ("get_weather", "get_time")


def test_a_streamed_call_is_the_call_the_whole_message_makes(p: Pipeline) -> None:
    """Temperature 0: the streamed ``input_json_delta`` events, put together by the
    client's helper, are the input of the same request answered whole."""
    c = claude(p)
    ask: dict[str, Any] = dict(model="smollm2", max_tokens=80, extra_body=COLD,
                               messages=QUESTION, tools=[WEATHER], tool_choice=NAMED)
    whole = c.messages.create(**ask)
    with c.messages.stream(**ask) as stream:
        kinds = {(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream}
        final = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.stop_reason == "tool_use"
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == [(b.name, b.input) for b in whole.content if b.type == "tool_use"]


def test_a_round_trip_with_the_tools_result(p: Pipeline) -> None:
    c = claude(p)
    first = c.messages.create(model="smollm2", max_tokens=80, extra_body=COLD,
                              messages=QUESTION, tools=[WEATHER], tool_choice=NAMED)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls
    history: list[Any] = [*QUESTION, {"role": "assistant", "content": [
        b.model_dump(exclude_none=True) for b in first.content]}]
    history.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}
        for call in calls]})
    final = c.messages.create(model="smollm2", max_tokens=60, extra_body=COLD,
                              messages=history, tools=[WEATHER])
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use"), final
    assert final.content
    # tool_choice none: the tools are known, and none is called
    plain = c.messages.create(model="smollm2", max_tokens=30, extra_body=COLD,
                              messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert plain.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in plain.content)

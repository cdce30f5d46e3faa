"""Tool calls through a real Conveyor on the real model (llama.cpp, two workers
of one context each), asked by clients nobody here wrote: the ``openai``
client (a required call, a named one streamed as OpenAI's deltas, a round trip
with the tool's result), LangChain's ``bind_tools`` and its
``with_structured_output`` in all three methods, an OpenAI Agents SDK agent
that calls a Python function, and a batch whose lines use tools. Tools
Conveyor cannot serve are a 400 naming the parameter (an engine that cannot
decode them refuses: test_structured.py). A worker SIGKILLed in the
middle of a streamed call leaves one call whose arguments parse and match
the function's parameters."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.faults.test_delivery import assert_continued_elsewhere, kill_its_worker
from tests.pipeline.test_batches import line, lines_of, upload, wait
from tests.support.pipeline import Pipeline, client
from tests.unit.schemas.test_tools import REFUSED

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.", "strict": True,
    "parameters": WEATHER_PARAMETERS}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "maxLength": 30}},
                   "required": ["zone"]}}}
# arguments long enough to kill a worker in the middle of
TRIP_PARAMETERS: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["stops"],
    "properties": {"stops": {"type": "array", "minItems": 10, "maxItems": 12,
                             "items": {"type": "string", "maxLength": 16}}}}
TRIP: dict[str, Any] = {"type": "function", "function": {
    "name": "plan_trip", "description": "Plan a trip through the cities given.",
    "strict": True, "parameters": TRIP_PARAMETERS}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def p(model_workers: Pipeline) -> Pipeline:
    return model_workers  # two workers of the real model (tests/conftest.py)



def test_a_required_call_answers_with_tool_calls(p: Pipeline) -> None:
    done = client(p).chat.completions.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=80)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_a_streamed_named_call_is_the_call_the_whole_answer_makes(p: Pipeline) -> None:
    """Temperature 0: the streamed deltas, put together, are the call the same
    request answers unstreamed (ids differ: they are the request's)."""
    c = client(p)
    ask: dict[str, Any] = dict(model="smollm2", messages=QUESTION, tools=[WEATHER, TIME],
                               tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}},
                               parallel_tool_calls=False, temperature=0, max_tokens=80)
    whole = c.chat.completions.create(**ask).choices[0].message.tool_calls
    assert whole
    calls: dict[int, dict[str, str]] = {}
    finish, pieces = None, 0
    for chunk in c.chat.completions.create(**ask, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            pieces += 1
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                call["id"], call["name"] = delta.id, delta.function.name or ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls" and pieces > 2, calls
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [
        (w.function.name, w.function.arguments) for w in whole]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMETERS)


def test_a_round_trip_with_the_tools_result(p: Pipeline) -> None:
    c = client(p)
    first = c.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=80).choices[0].message
    assert first.tool_calls
    history: list[Any] = [*QUESTION, first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}
                for call in first.tool_calls]
    final = c.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER],
                                      temperature=0, max_tokens=60).choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls"), final
    assert final.message.content or final.message.tool_calls


# -- clients nobody here wrote ----------------------------------------------------------


class Weather(BaseModel):
    """The weather a question asks about."""

    city: str = Field(max_length=30, description="the city")
    unit: str = Field(max_length=12, description="celsius or fahrenheit")


def test_langchain_bind_tools_completes_a_round_trip(p: Pipeline) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="smollm2", base_url=f"{p.base_url}/v1", api_key="unused",
                     temperature=0, max_tokens=80, max_retries=0)  # type: ignore[arg-type]
    bound = llm.bind_tools([Weather], tool_choice="Weather", parallel_tool_calls=False)
    question = HumanMessage("What is the weather in Paris?")
    answer = bound.invoke([question])
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "Weather", answer
    Weather.model_validate(answer.tool_calls[0]["args"])
    result = ToolMessage("18 C, sunny", tool_call_id=answer.tool_calls[0]["id"])
    final = llm.bind_tools([Weather]).invoke([question, answer, result])
    assert final.content or final.tool_calls, final


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(p: Pipeline, method: str) -> None:
    from langchain_openai import ChatOpenAI

    # json_object holds the answer to any JSON object: it may take longer to close
    llm = ChatOpenAI(model="smollm2", base_url=f"{p.base_url}/v1", api_key="unused",
                     temperature=0, max_tokens=300 if method == "json_mode" else 80,
                     max_retries=0)  # type: ignore[arg-type]
    if method == "json_mode":  # json_object holds the answer to JSON, not to a schema
        structured: Any = llm.with_structured_output(None, method="json_mode")
        got = structured.invoke(
            "Return a JSON object with the keys city and country for Paris.")
        assert isinstance(got, dict), got
        return
    structured = llm.with_structured_output(Weather, method=method,  # type: ignore[arg-type]
                                            strict=True)
    got = structured.invoke("What is the weather in Paris?")
    assert isinstance(got, Weather), got


@pytest.mark.parametrize("api", ["chat.completions", "responses"])
def test_an_agents_sdk_agent_calls_a_python_function(p: Pipeline, api: str) -> None:
    """On the chat completions model, and on the SDK's default, the Responses API."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # its traces would go to OpenAI
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        asked.append(city)
        return f"It is 18 C and sunny in {city}."

    made = OpenAIChatCompletionsModel if api == "chat.completions" else OpenAIResponsesModel
    model = made(model="smollm2", openai_client=openai.AsyncOpenAI(
        base_url=f"{p.base_url}/v1", api_key="unused", max_retries=0, timeout=120))
    # the function's result is the agent's answer: asked again with the result in
    # its history, a 135M model calls the function again rather than answer
    agent = Agent(name="weather", instructions="Answer with the tools you have.",
                  tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=60, parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert asked and "paris" in asked[0].lower(), asked
    assert any(item.type == "tool_call_output_item" for item in result.new_items), result
    assert result.final_output == f"It is 18 C and sunny in {asked[0]}.", result


# -- batches, refusals, faults -----------------------------------------------------------


def test_batch_lines_with_tools(p: Pipeline) -> None:
    c = client(p)
    made = line("weather", "What is the weather in Paris?", max_tokens=80)
    made["body"].update(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    batch = c.batches.create(input_file_id=upload(c, [made]), endpoint="/v1/chat/completions",
                             completion_window="24h")
    done = wait(c, batch.id, timeout=300)
    assert done.status == "completed", done
    [out] = lines_of(c, done.output_file_id)
    choice = out["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMETERS)


@pytest.mark.parametrize(("fields", "param"), [
    *REFUSED,
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]},
     "tools[0].function.name"),
])
def test_tools_that_cannot_be_served_are_a_400_naming_the_parameter(
        p: Pipeline, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(p).chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=5,
                                          **fields)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_a_worker_killed_mid_call_leaves_one_valid_call(p: Pipeline) -> None:
    c = client(p)
    killed: list[str] = []
    stream = c.chat.completions.create(
        model="smollm2", stream=True, max_tokens=300, temperature=0.7, seed=5,
        messages=[{"role": "user", "content": "Plan a trip through twelve cities of Europe."}],
        tools=[TRIP], tool_choice="required", parallel_tool_calls=False)
    arguments: list[str] = []
    request_id, finish = "", None
    for chunk in stream:
        request_id = request_id or chunk.id.removeprefix("chatcmpl-")
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            arguments.append(delta.function.arguments or "" if delta.function else "")
        if len(arguments) == 6 and not killed:  # well inside the list of stops
            kill_its_worker(p, request_id, killed)
    text = "".join(arguments)
    assert killed and finish == "tool_calls", text
    jsonschema.validate(json.loads(text), TRIP_PARAMETERS)
    assert_continued_elsewhere(p, request_id, killed)


# -- the Responses API ---------------------------------------------------------------------

RESPONSES_WEATHER: dict[str, Any] = {"type": "function", **WEATHER["function"]}


def test_a_response_calls_a_function_and_takes_its_output_back(p: Pipeline) -> None:
    c = client(p)
    first = c.responses.create(model="smollm2", input="What is the weather in Paris?",
                               tools=[RESPONSES_WEATHER], tool_choice="required",
                               parallel_tool_calls=False, temperature=0,
                               max_output_tokens=80)
    assert first.status == "completed", first
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id == "fc_" + call.call_id.removeprefix("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    again = c.responses.retrieve(first.id)  # stored, read back from the log
    assert [item.model_dump() for item in again.output] == [
        item.model_dump() for item in first.output]
    final = c.responses.create(
        model="smollm2", tools=[RESPONSES_WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=40,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C, sunny"}])
    assert final.status in ("completed", "incomplete") and final.output_text, final


def test_a_response_continues_after_its_call_with_the_call_s_output(p: Pipeline) -> None:
    """The call's output sent back with ``previous_response_id`` alone: the
    first response's input and its call are the conversation before it."""
    c = client(p)
    first = c.responses.create(model="smollm2", input="What is the weather in Paris?",
                               tools=[RESPONSES_WEATHER], tool_choice="required",
                               parallel_tool_calls=False, temperature=0,
                               max_output_tokens=80)
    [call] = [item for item in first.output if item.type == "function_call"]
    final = c.responses.create(
        model="smollm2", tools=[RESPONSES_WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=40, previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C, sunny"}])
    assert final.status in ("completed", "incomplete") and final.output_text, final
    assert final.previous_response_id == first.id
    [own] = c.responses.input_items.list(final.id).data
    assert own.type == "function_call_output" and own.call_id == call.call_id  # type: ignore[union-attr]


def test_an_agents_sdk_run_continues_a_previous_one(p: Pipeline) -> None:
    """The Agents SDK's own chaining: a second run given the first's last
    response id sends only its new input, with ``previous_response_id``."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to OpenAI
    model = OpenAIResponsesModel(model="smollm2", openai_client=openai.AsyncOpenAI(
        base_url=f"{p.base_url}/v1", api_key="unused", max_retries=0, timeout=120))
    agent = Agent(name="counter", instructions="Answer briefly.", model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=16))

    async def both() -> tuple[Any, Any]:  # one loop: the client is bound to it
        first = await Runner.run(agent, "Name a colour.", max_turns=1)
        return first, await Runner.run(agent, "Name another one.", max_turns=1,
                                       previous_response_id=first.last_response_id)

    first, second = asyncio.run(both())
    assert first.last_response_id is not None and first.final_output
    assert second.final_output
    [raw] = second.raw_responses
    c = client(p)
    assert c.responses.retrieve(raw.response_id).previous_response_id == first.last_response_id  # type: ignore[arg-type]
    [own] = c.responses.input_items.list(raw.response_id).data  # type: ignore[arg-type]
    assert own.content[0].text == "Name another one."  # type: ignore[union-attr]


def test_a_streamed_response_call_is_the_call_the_whole_response_makes(p: Pipeline) -> None:
    c = client(p)
    ask: dict[str, Any] = dict(model="smollm2", input="What is the weather in Paris?",
                               tools=[RESPONSES_WEATHER], parallel_tool_calls=False,
                               tool_choice={"type": "function", "name": "get_weather"},
                               temperature=0, max_output_tokens=80)
    whole = c.responses.create(**ask)
    kinds, deltas, done = [], [], None
    for event in c.responses.create(**ask, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            done = event.response
    assert done is not None and kinds[:3] == ["response.created", "response.in_progress",
                                              "response.output_item.added"], kinds
    assert "response.function_call_arguments.done" in kinds and len(deltas) > 1, kinds
    [call] = [item for item in done.output if item.type == "function_call"]
    assert "".join(deltas) == call.arguments
    [expected] = [item for item in whole.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.name, expected.arguments)

"""OpenAI's Responses API through the whole pipeline, driven by the official client.

The Responses API has no ``seed``, and the llama.cpp engine reuses the prompt
prefix of what it served before for unseeded requests, so the same greedy
request may answer differently from one time to the next: these tests compare
what is exact (token counts, the text of one response across its events),
never the text of two responses."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.pipeline import Pipeline, client

QUESTION = "What is the capital of France?"

LIFECYCLE = ["response.created", "response.in_progress", "response.output_item.added",
             "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done",
           "response.output_item.done"]



def check_usage(r: Any) -> None:
    assert r.usage is not None
    assert r.usage.input_tokens > 5 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the engine's prefix reuse: earlier tests' prompts share the template's system prompt
    assert 0 <= r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_a_plain_response(pipeline: Pipeline) -> None:
    r = client(pipeline).responses.create(model="smollm2", input=QUESTION,
                                          max_output_tokens=32, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.error is None
    assert r.model == "smollm2" and r.temperature == 0 and r.max_output_tokens == 32
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id == "msg_" + r.id.removeprefix("resp_")
    assert r.output_text.strip() and r.output_text == message.content[0].text
    check_usage(r)
    assert r.usage is not None and r.usage.output_tokens <= 32
    assert r.background is False and r.tools == [] and r.parallel_tool_calls is True


def test_instructions_come_first_as_a_system_message(pipeline: Pipeline) -> None:
    c = client(pipeline)
    told = c.responses.create(model="smollm2", input=QUESTION, max_output_tokens=8,
                              temperature=0, instructions="Answer in one word, in French.")
    assert told.instructions == "Answer in one word, in French."
    check_usage(told)
    assert told.usage is not None
    # the prompt is the one of a chat request with that system message (without
    # one, SmolLM2's template adds its own: the token counts alone would not tell)
    chat = c.chat.completions.create(model="smollm2", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word, in French."},
        {"role": "user", "content": QUESTION}])
    assert chat.usage is not None and chat.usage.prompt_tokens == told.usage.input_tokens


def test_list_input_of_message_items(pipeline: Pipeline) -> None:
    c = client(pipeline)
    as_string = c.responses.create(model="smollm2", input=QUESTION, max_output_tokens=12,
                                   temperature=0)
    as_parts = c.responses.create(model="smollm2", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is the capital "},
                                     {"type": "input_text", "text": "of France?"}]}])
    assert as_parts.output_text.strip()
    assert as_parts.usage is not None and as_string.usage is not None
    assert as_parts.usage.input_tokens == as_string.usage.input_tokens
    turns = c.responses.create(model="smollm2", max_output_tokens=12, temperature=0, input=[
        {"role": "developer", "content": "You are a geography teacher."},
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": as_string.output_text},
        {"role": "user", "content": "And of Italy?"}])
    check_usage(turns)
    assert turns.output_text.strip()
    assert turns.usage is not None and turns.usage.input_tokens > as_string.usage.input_tokens


def test_streamed_events_in_order_with_sequence_numbers(pipeline: Pipeline) -> None:
    c = client(pipeline)
    events = list(c.responses.create(model="smollm2", input=QUESTION, max_output_tokens=24,
                                     temperature=0, instructions="Be brief.", stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == LIFECYCLE and deltas
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):-1] == CLOSING
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert final.id == created.id and final.instructions == "Be brief."
    text = "".join(d.delta for d in deltas)
    done = events[4 + len(deltas)]
    assert done.type == "response.output_text.done" and done.text == text
    assert final.output_text == text and all(d.item_id == final.output[0].id for d in deltas)
    check_usage(final)
    assert final.usage is not None and final.usage.output_tokens <= 24


def test_the_output_budget_running_out_is_incomplete(pipeline: Pipeline) -> None:
    c = client(pipeline)
    r = c.responses.create(model="smollm2", input="Write a long story about a dragon.",
                           max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete" and r.output_text
    events = list(c.responses.create(model="smollm2", input="Write a long story about a dragon.",
                                     max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3
    assert events[-1].response.output_text == "".join(
        e.delta for e in events if e.type == "response.output_text.delta")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strin"}}}},
     "text.format.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True, "store": False}, "store"),
])
def test_what_is_not_served_is_a_400_naming_the_param(pipeline: Pipeline, extra: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(pipeline).responses.create(model="smollm2", input=QUESTION,
                                          max_output_tokens=8, **extra)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_failures_before_the_first_token_are_http_errors(pipeline: Pipeline) -> None:
    c = client(pipeline)
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.create(model="no-such-model", input=QUESTION, stream=True)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:  # named as the Responses API names it
        c.responses.create(model="smollm2", input="Hello. " * 20, max_output_tokens=5000,
                           stream=True)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "input"
    r = httpx.post(f"{pipeline.base_url}/v1/responses", timeout=30, content=b'{"model": '
                   b'"smollm2", "input": [{"role": "user", "content": "a\\ud800"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content"


def test_the_wire_format_names_each_event(pipeline: Pipeline) -> None:
    with httpx.stream("POST", f"{pipeline.base_url}/v1/responses", timeout=60, json={
        "model": "smollm2", "input": QUESTION, "max_output_tokens": 4, "stream": True,
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    for event, data in pairs:
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")
    assert pairs[-1][0] in ("event: response.completed", "event: response.incomplete")

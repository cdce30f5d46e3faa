"""The stream's events, read by the official client's own event types and by the
state machine of its ``responses.stream`` helper."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.responses.events import ResponseEvents, frame
from schemas.openai.responses import parse_request
from schemas.records import ErrorInfo

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 7, "completion_tokens": 3}


def events_of(max_output_tokens: int | None = None) -> ResponseEvents:
    body = parse_request(json.dumps({"model": "smollm2", "input": "Hi", "stream": True,
                                     "max_output_tokens": max_output_tokens}).encode())
    return ResponseEvents("resp_abc", 1700000000, body)


def typed(events: list[dict[str, Any]]) -> list[Any]:
    return [EVENT.validate_python(e) for e in events]


def test_a_whole_stream_in_order_numbered_from_zero() -> None:
    stream = events_of()
    raw = [*stream.opening(), *stream.delta("Par"), *stream.delta(""), *stream.delta("is."),
           *stream.closing("stop", USAGE, 1700000001)]  # type: ignore[arg-type]
    events = typed(raw)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(10))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.id == "msg_abc" and events[2].item.content == []
    assert all(e.item_id == "msg_abc" for e in events[3:8])
    assert events[6].text == "Paris." and events[7].part.text == "Paris."
    assert events[8].item.status == "completed"
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Paris."
    assert final.usage.total_tokens == 10
    # the client's stream helper accepts the sequence and gives the final response
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(event)
    assert state._completed_response is not None
    assert state._completed_response.output_text == "Paris."


def test_a_spent_output_budget_ends_with_response_incomplete() -> None:
    stream = events_of(max_output_tokens=2)
    events = typed([*stream.opening(), *stream.delta("Once upon"),
                    *stream.closing("length", USAGE, 1)])  # type: ignore[arg-type]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


def test_a_failure_mid_stream_ends_with_response_failed() -> None:
    stream = events_of()
    error = ErrorInfo(status=500, type="server_error", code="engine_error", param=None,
                      message="The engine failed.")
    events = typed([*stream.opening(), *stream.delta("Par"), *stream.failure(error)])
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == "The engine failed."
    assert failed.output_text == "Par" and failed.output[0].status == "incomplete"
    with pytest.raises(RuntimeError, match="already ended"):
        stream.delta("more")


def test_each_event_is_framed_with_its_type() -> None:
    event = events_of().opening()[0]
    raw = frame(event)
    name, data, end = raw.split(b"\n", 2)
    assert name == b"event: response.created" and end == b"\n"
    assert json.loads(data.removeprefix(b"data: ")) == event

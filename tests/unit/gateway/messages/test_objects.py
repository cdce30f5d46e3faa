"""The Message of a whole answer, its usage and stop reason, and Anthropic's
error types by status."""

from __future__ import annotations

import pytest

from gateway.messages.objects import (
    error_of,
    message_object,
    stop_reason,
    usage_object,
)
from schemas.records import Usage

USAGE = Usage(prompt_tokens=30, completion_tokens=7, cached_tokens=12)


def test_a_text_answer_is_one_text_block() -> None:
    m = message_object("r1", "smollm2", "Paris.", [], "stop", USAGE, [])
    assert m == {"id": "msg_r1", "type": "message", "role": "assistant", "model": "smollm2",
                 "content": [{"type": "text", "text": "Paris."}], "stop_reason": "end_turn",
                 "stop_sequence": None, "usage": {
                     "input_tokens": 18, "output_tokens": 7,
                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 12}}


def test_calls_are_tool_use_blocks_after_the_text() -> None:
    calls = [{"id": "call_abc", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_def", "type": "function",
              "function": {"name": "get_time", "arguments": ""}}]
    m = message_object("r1", "smollm2", None, calls, "tool_calls", USAGE, [])
    assert m["content"] == [
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
         "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_def", "name": "get_time", "input": {}}]
    assert m["stop_reason"] == "tool_use"


@pytest.mark.parametrize(("finish", "stops", "expected"), [
    ("stop", [], ("end_turn", None)),
    (None, [], ("end_turn", None)),
    ("length", ["x"], ("max_tokens", None)),
    ("tool_calls", [], ("tool_use", None)),
    ("content_filter", [], ("refusal", None)),
    ("stop", ["END"], ("stop_sequence", "END")),
    ("stop", ["A", "B"], ("stop_sequence", None)),
])
def test_stop_reasons(finish: str | None, stops: list[str],
                      expected: tuple[str, str | None]) -> None:
    assert stop_reason(finish, stops) == expected


def test_usage_before_any_is_zero() -> None:
    assert usage_object(None) == {"input_tokens": 0, "output_tokens": 0,
                                  "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 0}


@pytest.mark.parametrize(("status", "expected"), [
    (400, ("invalid_request_error", 400)), (422, ("invalid_request_error", 400)),
    (401, ("authentication_error", 401)), (403, ("permission_error", 403)),
    (404, ("not_found_error", 404)), (413, ("request_too_large", 413)),
    (429, ("rate_limit_error", 429)), (500, ("api_error", 500)),
    (503, ("overloaded_error", 529)), (504, ("timeout_error", 504)),
    (418, ("invalid_request_error", 418)), (507, ("api_error", 507)),
])
def test_error_types_by_status(status: int, expected: tuple[str, int]) -> None:
    sent, body = error_of(status, "x")
    assert (body["error"]["type"], sent) == expected


def test_the_error_body() -> None:
    assert error_of(404, "no", None, "r1") == (404, {
        "type": "error", "error": {"type": "not_found_error", "message": "no"},
        "request_id": "r1"})
    assert "request_id" not in error_of(500, "x")[1]


def test_a_param_leads_the_message_unless_it_names_it() -> None:
    assert error_of(400, "too many", "max_tokens")[1]["error"]["message"] == \
        "max_tokens: too many"
    assert error_of(400, "max_tokens: too many", "max_tokens")[1]["error"]["message"] == \
        "max_tokens: too many"

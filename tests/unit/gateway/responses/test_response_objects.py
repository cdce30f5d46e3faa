"""The Response object, checked against the official client's own types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from gateway.responses.objects import new_response_id, response_object
from schemas.openai.responses import ResponsesRequest, parse_request
from schemas.records import ErrorInfo

USAGE = {"prompt_tokens": 11, "completion_tokens": 5}


def body(**fields: Any) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "smollm2", "input": "Hi", **fields}).encode())


def typed(obj: dict[str, Any]) -> Response:
    """What the client makes of it, validated strictly (the client itself does not)."""
    return Response.model_validate(obj)


def test_a_completed_response() -> None:
    rid = new_response_id("abc123")
    obj = response_object(rid, 1700000000, body(instructions="Be brief.", max_output_tokens=9,
                                                temperature=0.5, metadata={"k": "v"}),
                          "completed", text="Paris.", usage=USAGE,  # type: ignore[arg-type]
                          finish_reason="stop", completed_at=1700000001)
    r = typed(obj)
    assert r.id == "resp_abc123" and r.object == "response" and r.status == "completed"
    assert r.output_text == "Paris." and "output_text" not in obj
    [message] = r.output
    assert message.type == "message" and message.id == "msg_abc123"
    assert message.status == "completed" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (11, 5, 16)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 9
    assert r.temperature == 0.5 and r.top_p == 1.0 and r.metadata == {"k": "v"}
    assert r.error is None and r.incomplete_details is None and r.completed_at == 1700000001
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.text is not None and r.text.format is not None and r.text.format.type == "text"
    assert r.background is False and r.store is True  # kept unless store is false


def test_a_response_asked_with_store_false_says_it_is_not_kept() -> None:
    r = typed(response_object("resp_1", 1, body(store=False), "completed", text="Hi",
                              usage=USAGE, completed_at=2))  # type: ignore[arg-type]
    assert r.store is False


def test_a_length_finish_is_incomplete_for_max_output_tokens() -> None:
    r = typed(response_object("resp_1", 1, body(max_output_tokens=3), "completed", text="Once",
                              usage=USAGE, finish_reason="length",  # type: ignore[arg-type]
                              completed_at=2))
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.completed_at is None


def test_a_response_not_started_has_no_output_and_no_usage() -> None:
    for status in ("queued", "in_progress"):
        r = typed(response_object("resp_2", 1, body(background=True), status))  # type: ignore[arg-type]
        assert r.status == status and r.output == [] and r.usage is None
        assert r.background is True and r.store is True


def test_a_failed_response_carries_its_error() -> None:
    error = ErrorInfo(status=504, type="timeout", code="deadline_exceeded", param=None,
                      message="The request did not finish within its deadline.")
    r = typed(response_object("resp_3", 1, body(), "failed", text="Par", error=error))
    assert r.status == "failed" and r.error is not None
    assert r.error.code == "server_error" and "deadline" in r.error.message
    assert r.output[0].status == "incomplete" and r.output_text == "Par"
    limited = ErrorInfo(status=429, type="requests", code="rate_limit_exceeded", param=None,
                        message="Slow down.")
    assert typed(response_object("resp_4", 1, body(), "failed",
                                 error=limited)).error.code == "rate_limit_exceeded"  # type: ignore[union-attr]
    # the error shows only on a failed response
    assert response_object("resp_5", 1, body(), "cancelled", error=error)["error"] is None


def test_an_unknown_status_is_a_bug() -> None:
    with pytest.raises(ValueError, match="unknown response status"):
        response_object("resp_6", 1, body(), "done")  # type: ignore[arg-type]


def test_new_ids_are_unique_hex() -> None:
    a, b = new_response_id(), new_response_id()
    assert a != b and a.startswith("resp_") and int(a.removeprefix("resp_"), 16) >= 0

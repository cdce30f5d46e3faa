"""The WebSocket messages: what a client may send, what the server sends."""

from __future__ import annotations

import json

import pytest

from conveyor.errors import InvalidApiKey, InvalidRequest, PipelineUnavailable, RateLimited
from gateway.websocket.chat import validated
from gateway.websocket.protocol import (
    INVALID_PAYLOAD,
    POLICY_VIOLATION,
    TRY_AGAIN_LATER,
    CancelMessage,
    FrameError,
    RequestMessage,
    chunk_frame,
    close_code_of,
    close_reason,
    encode,
    error_message,
    parse_multiplexed,
    parse_response_create,
    response_error_event,
)


def test_request_and_cancel_messages_are_parsed() -> None:
    body = {"model": "m", "messages": []}
    assert parse_multiplexed(json.dumps({"type": "request", "id": "a", "body": body})) == \
        RequestMessage("a", body)
    assert parse_multiplexed('{"type": "cancel", "id": "a"}') == CancelMessage("a")


@pytest.mark.parametrize("frame", [
    "not json", "[1, 2]", '{"type": "hello", "id": "a"}', '{"type": "request", "body": {}}',
    '{"type": "cancel", "id": ""}', '{"type": "cancel", "id": 7}',
    json.dumps({"type": "cancel", "id": "x" * 257}),
])
def test_a_frame_outside_the_protocol_is_a_frame_error(frame: str) -> None:
    with pytest.raises(FrameError) as caught:
        parse_multiplexed(frame)
    assert caught.value.code == INVALID_PAYLOAD and caught.value.reason


def test_response_create_in_openais_shape_and_the_nested_one() -> None:
    flat = parse_response_create(json.dumps({"type": "response.create", "model": "m",
                                             "input": "hi", "stream": False,
                                             "stream_id": "s1"}))
    assert flat.fields == {"model": "m", "input": "hi", "stream": True}
    nested = parse_response_create(json.dumps({"type": "response.create",
                                               "response": {"model": "m", "input": "hi"}}))
    assert nested.fields == {"model": "m", "input": "hi", "stream": True}
    with pytest.raises(FrameError):
        parse_response_create('{"type": "response.cancel"}')


def test_a_close_reason_fits_a_close_frame() -> None:
    assert close_reason("short") == "short"
    cut = close_reason("é" * 200)
    assert len(cut.encode()) <= 123 and cut.endswith("...")


def test_handshake_refusals_close_with_policy_violation_or_try_again() -> None:
    assert close_code_of(InvalidApiKey("bad key")) == POLICY_VIOLATION
    assert close_code_of(PipelineUnavailable("starting")) == TRY_AGAIN_LATER


def test_server_messages() -> None:
    chunk = '{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[]}'
    assert json.loads(chunk_frame('a"b', chunk)) == {"type": "chunk", "id": 'a"b',
                                                     "data": json.loads(chunk)}
    err = error_message("a", RateLimited("slow down"))
    assert err == {"type": "error", "id": "a", "status": 429,
                   "error": {"message": "slow down", "type": "requests", "param": None,
                             "code": "rate_limit_exceeded"}}
    event = response_error_event(InvalidRequest("bad", param="input"))
    assert event == {"type": "error", "code": None, "message": "bad", "param": "input",
                     "status": 400, "sequence_number": 0}


def test_text_utf8_cannot_hold_is_escaped() -> None:
    text = encode({"message": "bad \ud800"})
    text.encode("utf-8")
    assert json.loads(text) == {"message": "bad \ud800"}
    assert encode({"m": "é"}) == '{"m":"é"}'


def test_a_body_is_validated_as_over_http_and_always_streams() -> None:
    generation = validated("chat", {"model": "m", "stream": False,
                                    "messages": [{"role": "user", "content": "hi"}]})
    assert generation["kind"] == "chat" and generation["stream"] is True
    assert validated("completion", {"model": "m", "prompt": "x"})["kind"] == "completion"
    with pytest.raises(InvalidRequest) as caught:
        validated("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]})
    assert caught.value.param == "messages[0].content"
    with pytest.raises(InvalidRequest) as not_object:
        validated("chat", ["no"])
    assert not_object.value.param == "body"


def test_an_image_part_is_refused_naming_it() -> None:
    """Images are read and stored by POST /v1/chat/completions alone."""
    with pytest.raises(InvalidRequest, match="POST /v1/chat/completions only") as caught:
        validated("chat", {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert caught.value.param == "messages[0].content[0]"


def test_a_message_nested_past_the_json_parser_is_a_frame_error() -> None:
    with pytest.raises(FrameError) as info:
        parse_multiplexed("[" * 100_000 + "]" * 100_000)
    assert info.value.code == INVALID_PAYLOAD and "nested" in str(info.value)

"""A streamed Message's events made from the chat chunks postprocess writes."""

from __future__ import annotations

import json
from typing import Any

from gateway.messages.events import MessageEvents, frame
from gateway.messages.objects import error_of
from schemas.records import Usage


def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    return json.dumps({"id": "chatcmpl-r1", "object": "chat.completion.chunk",
                       "model": "smollm2", "choices": [
                           {"index": 0, "delta": delta, "finish_reason": finish}]})


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] + (":" + e["delta"]["type"] if e["type"] == "content_block_delta"
                         else "") for e in events]


def test_text_streams_as_one_text_block() -> None:
    ev = MessageEvents("r1", "smollm2", [])
    [start] = ev.opening()
    assert start["message"]["id"] == "msg_r1" and start["message"]["content"] == []
    assert start["message"]["stop_reason"] is None
    first = ev.chunks(chunk({"role": "assistant", "content": ""}) + "\n" +
                      chunk({"content": "Hel"}))
    more = ev.chunks(chunk({"content": "lo"}) + "\n" + chunk({}, "stop"))
    end = ev.closing("stop", Usage(prompt_tokens=9, completion_tokens=2))
    assert kinds(first + more + end) == [
        "content_block_start", "ping", "content_block_delta:text_delta",
        "content_block_delta:text_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert first[0]["content_block"] == {"type": "text", "text": ""}
    assert [e["delta"]["text"] for e in first + more if e["type"] == "content_block_delta"] \
        == ["Hel", "lo"]
    assert end[1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end[1]["usage"]["output_tokens"] == 2 and end[1]["usage"]["input_tokens"] == 9


def test_calls_stream_as_tool_use_blocks_of_input_json() -> None:
    ev = MessageEvents("r1", "smollm2", [])
    events = ev.chunks("\n".join([
        chunk({"content": "Looking."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_time", "arguments": ""}}]}),
        chunk({}, "tool_calls")]))
    events += ev.closing("tool_calls", Usage(prompt_tokens=9, completion_tokens=20))
    assert kinds(events) == [
        "content_block_start", "ping", "content_block_delta:text_delta", "content_block_stop",
        "content_block_start", "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta", "content_block_stop",
        "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "toolu_a",
                                          "name": "get_weather", "input": {}}
    json_text = "".join(e["delta"]["partial_json"] for e in events
                        if e["type"] == "content_block_delta" and e["index"] == 1)
    assert json.loads(json_text) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_an_answer_without_content_has_no_block() -> None:
    ev = MessageEvents("r1", "smollm2", ["7"])
    events = ev.chunks(chunk({"role": "assistant", "content": ""}))
    events += ev.closing("stop", None)
    assert kinds(events) == ["message_delta", "message_stop"]
    assert events[0]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "7"}


def test_a_failure_and_the_frame() -> None:
    _, error = error_of(503, "busy")
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert frame(error) == (b'event: error\ndata: {"type":"error","error":'
                            b'{"type":"overloaded_error","message":"busy"}}\n\n')

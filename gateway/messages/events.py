"""The events of a streamed Message, in Anthropic's order: ``message_start``;
per content block ``content_block_start``, its ``content_block_delta`` events
(``text_delta``, or ``input_json_delta`` for a ``tool_use`` block's input) and
``content_block_stop``; then ``message_delta`` (``stop_reason``, ``usage``)
and ``message_stop``. A ``ping`` follows the first block's start and stands
for a keep-alive. They are made from the chat chunks postprocess writes (the
same text and tool calls a chat stream carries); a failure once the stream
began is an ``error`` event."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway import sse
from gateway.messages.objects import message_id, stop_reason, usage_object
from gateway.messages.protocol import tool_use_id
from schemas.records import Usage

__all__ = ["MessageEvents", "frame", "PING"]

PING: dict[str, Any] = {"type": "ping"}


def frame(event: dict[str, Any]) -> bytes:
    """One event as SSE: ``event: <type>`` and its JSON as ``data:``."""
    return sse.json_data(event, event=str(event["type"]))


@dataclass
class MessageEvents:
    """The event builder of one streamed Message."""

    request_id: str
    model: str
    stops: list[str]
    # the block being streamed: its index and kind (None: none is open)
    index: int = -1
    open: Literal["text", "tool_use"] | None = None
    pinged: bool = False
    finish_reason: str | None = None
    _calls: dict[int, int] = field(default_factory=dict)  # call index -> block index

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {
            "id": message_id(self.request_id), "type": "message", "role": "assistant",
            "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_object(None)}}]

    def text(self, text: str) -> list[dict[str, Any]]:
        """The events of a reply's text, for an answer of text alone (no tool
        calls to read): its chunks would say the same, as JSON to decode."""
        out: list[dict[str, Any]] = []
        if text:
            self._text(text, out)
        return out

    def chunks(self, text: str) -> list[dict[str, Any]]:
        """The events of a reply's chat chunks (one JSON object a line)."""
        out: list[dict[str, Any]] = []
        for line in text.split("\n") if text else ():
            chunk = json.loads(line)
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self._text(delta["content"], out)
                for call in delta.get("tool_calls") or ():
                    self._call(call, out)
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
        return out

    def closing(self, finish_reason: str | None, usage: Usage | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._close(out)
        reason, sequence = stop_reason(finish_reason or self.finish_reason, self.stops)
        return out + [{"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": usage_object(usage)},
                      {"type": "message_stop"}]

    def _start(self, block: dict[str, Any], kind: Literal["text", "tool_use"],
               out: list[dict[str, Any]]) -> None:
        self._close(out)
        self.index += 1
        self.open = kind
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        if not self.pinged:
            self.pinged = True
            out.append(PING)

    def _close(self, out: list[dict[str, Any]]) -> None:
        if self.open is not None:
            out.append({"type": "content_block_stop", "index": self.index})
            self.open = None

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        if self.open != "text":
            self._start({"type": "text", "text": ""}, "text", out)
        out.append({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "text_delta", "text": text}})

    def _call(self, call: dict[str, Any], out: list[dict[str, Any]]) -> None:
        function = call.get("function") or {}
        if call.get("id"):
            self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                         "name": function.get("name") or "", "input": {}}, "tool_use", out)
            self._calls[int(call.get("index", 0))] = self.index
        arguments = function.get("arguments") or ""
        if arguments and self._calls.get(int(call.get("index", 0))) == self.index:
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": arguments}})

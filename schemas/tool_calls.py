"""Reading an answer's text into OpenAI's tool calls, as it streams or whole
(schemas/tools.py's ``<tool_call>`` blocks): one deterministic reader for
postprocess and the gateway, so they all read the same calls with the same ids."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ToolCallReader", "ToolEvent", "ReadCalls", "call_id", "read_tool_calls", "OPEN",
           "CLOSE"]

# the tags around one call in an answer's text
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id(request_id: str, index: int) -> str:
    """The id of the ``index``-th call of a request's answer: the same wherever,
    and however often, the answer is read."""
    digest = hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


@dataclass
class ToolEvent:
    """What the reader found in the text: ``content``, or a call's start (its
    ``index``, ``id`` and ``name``), or more of its ``arguments``."""

    kind: Literal["content", "call", "arguments"]
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallReader:
    """Reads an answer's text, as it streams, into content and tool calls
    (what it releases when: docs/decisions/0019-tool-calls-as-text.md)."""

    request_id: str
    calls: int = 0
    _buffer: str = ""
    _state: Literal["content", "head", "arguments", "tail"] = "content"
    _space: str = ""
    _said: bool = False  # content other than whitespace was released
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    broken: list[str] = field(default_factory=list)  # blocks that were not calls

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        out: list[ToolEvent] = []
        while True:
            before = (self._state, len(self._buffer))
            getattr(self, f"_read_{self._state}")(out)
            if (self._state, len(self._buffer)) == before:
                return out

    def finish(self) -> list[ToolEvent]:
        """The text held back at the end of the answer."""
        out: list[ToolEvent] = []
        if self._state == "content" and self._buffer:
            self._content(out, self._buffer)
        elif self._state == "head" and self._buffer:
            self.broken.append(OPEN + self._buffer)
        self._buffer = ""
        return out

    def _content(self, out: list[ToolEvent], text: str) -> None:
        if not text:
            return
        if text.strip() == "" and (self.calls or not self._said):
            self._space += text
            return
        if self.calls and not self._said:
            self._space = ""  # content after a call: its leading whitespace is spacing
        out.append(ToolEvent("content", self._space + text))
        self._space, self._said = "", True

    def _read_content(self, out: list[ToolEvent]) -> None:
        at = self._buffer.find(OPEN)
        if at >= 0:
            self._content(out, self._buffer[:at])
            self._buffer = self._buffer[at + len(OPEN):]
            self._state = "head"
            return
        keep = _partial_suffix(self._buffer, OPEN)
        self._content(out, self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _read_head(self, out: list[ToolEvent]) -> None:
        match = _HEAD.match(self._buffer)
        if match is not None and match.end() < len(self._buffer):
            name = json.loads(f'"{match.group(1)}"')
            self._start(out, name)
            self._buffer = self._buffer[match.end():]
            self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, \
                False
            return
        end = self._buffer.find(CLOSE)
        if end < 0:
            return
        body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
        self._state = "content"
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # nested past the parser: not a call either
            value = None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            self.broken.append(f"{OPEN}{body}{CLOSE}")
            return
        arguments = value.get("arguments", {})
        self._start(out, value["name"])
        text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                       ensure_ascii=False)
        out.append(ToolEvent("arguments", text, index=self.calls - 1))

    def _start(self, out: list[ToolEvent], name: str) -> None:
        out.append(ToolEvent("call", index=self.calls, id=call_id(self.request_id, self.calls),
                             name=name))
        self.calls += 1

    def _read_arguments(self, out: list[ToolEvent]) -> None:
        """The arguments' JSON as it comes, up to the end of its value: an
        object or array closes at depth 0, a string at its closing quote, a
        bare scalar (a malformed call) before the ``,`` or ``}`` after it."""
        taken, done, back = 0, False, 0
        for ch in self._buffer:
            taken += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    done = self._depth == 0
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]" and self._depth > 0:
                self._depth -= 1
                done = self._depth == 0
            elif ch in ",}]" and self._depth == 0:
                done, back = True, 1
            if done:
                break
        piece = self._buffer[:taken - back]
        self._buffer = self._buffer[taken - back:]
        if piece:
            out.append(ToolEvent("arguments", piece, index=self.calls - 1))
        if done:
            self._state = "tail"

    def _read_tail(self, out: list[ToolEvent]) -> None:
        end = self._buffer.find(CLOSE)
        if end < 0:
            return
        self._buffer = self._buffer[end + len(CLOSE):]
        self._state = "content"


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReadCalls:
    """A whole answer read: its content (None when it is only calls), its calls
    in OpenAI's shape, and blocks that were not calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    broken: list[str]


def read_tool_calls(request_id: str, text: str) -> ReadCalls:
    """The whole answer read by :class:`ToolCallReader` in one go: exactly what
    a stream of it releases, put together."""
    reader = ToolCallReader(request_id)
    events = reader.feed(text) + reader.finish()
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for event in events:
        if event.kind == "content":
            content.append(event.text)
        elif event.kind == "call":
            calls.append({"id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": ""}})
        else:
            calls[event.index]["function"]["arguments"] += event.text
    joined = "".join(content)
    return ReadCalls(joined if joined or not calls else None, calls, reader.broken)

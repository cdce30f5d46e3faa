"""Personal data kept out of the log (docs/decisions/0016-personal-data-redacted-at-the-edge.md):
the originals of a redacted request's placeholders put back into its answer
(:class:`ReplyRestorer`, a placeholder split across replies restored whole).
They live only in this gateway's memory."""

from __future__ import annotations

import json
from typing import Any

from conveyor.policy.restore import Restorer
from schemas.openai.chunks import compact_json
from schemas.records import Reply

__all__ = ["ReplyRestorer"]


class ReplyRestorer:
    """The originals put back into one answer's replies, in order: the reply's
    text, and the text in its OpenAI chunk objects (chat deltas' content and
    tool-call arguments, completions' text), each a stream of its own."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self._text = Restorer(mapping)
        self._chunks: dict[tuple[int, str], Restorer] = {}
        self._mapping = mapping

    def apply(self, reply: Reply) -> Reply:
        final = reply["kind"] == "final"
        if self._text.idle_for(reply["text"]) and self._text.idle_for(reply["chunk"]) \
                and not any(r.held for r in self._chunks.values()):
            return reply  # no placeholder can begin in it and nothing is held
        text = self._text.feed(reply["text"]) + (self._text.flush() if final else "")
        lines = [self._chunk(line, final) for line in reply["chunk"].split("\n")] \
            if reply["chunk"] else []
        if final:
            lines = self._flushed(lines)
        return {**reply, "text": text, "chunk": "\n".join(lines)}

    def _restorer(self, field: tuple[int, str]) -> Restorer:
        found = self._chunks.get(field)
        if found is None:
            found = self._chunks[field] = Restorer(self._mapping)
        return found

    def _chunk(self, line: str, final: bool) -> str:
        if "<" not in line and not any(r.held for r in self._chunks.values()):
            return line
        obj = json.loads(line)
        for choice in obj.get("choices") or ():
            delta = choice.get("delta")
            if delta is None and isinstance(choice.get("text"), str):
                choice["text"] = self._restorer((0, "text")).feed(choice["text"])
                continue
            if not isinstance(delta, dict):
                continue
            if isinstance(delta.get("content"), str):
                delta["content"] = self._restorer((0, "content")).feed(delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = self._restorer(
                        (int(call.get("index", 0)), "arguments")).feed(function["arguments"])
        return compact_json(obj)

    def _flushed(self, lines: list[str]) -> list[str]:
        """The held rest of each field, in the last chunk that has choices."""
        rest = {field: r.flush() for field, r in self._chunks.items()}
        rest = {field: text for field, text in rest.items() if text}
        if not rest:
            return lines
        for i in range(len(lines) - 1, -1, -1):
            obj: dict[str, Any] = json.loads(lines[i])
            if obj.get("choices"):
                choice = obj["choices"][0]
                for (index, name), text in rest.items():
                    _append(choice, index, name, text)
                lines[i] = compact_json(obj)
                break
        return lines


def _append(choice: dict[str, Any], index: int, name: str, text: str) -> None:
    if name == "text":
        choice["text"] = (choice.get("text") or "") + text
        return
    delta = choice.setdefault("delta", {})
    if name == "content":
        delta["content"] = (delta.get("content") or "") + text
        return
    delta.setdefault("tool_calls", []).append(
        {"index": index, "function": {"arguments": text}})

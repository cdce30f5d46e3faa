"""The output items of a Response (OpenAI's Responses API), shared by the
gateway, which builds responses, and the jobs layer, which finishes background
ones: the assistant's message, and with function tools the ``function_call``
items read from the answer's text (:class:`OutputBuilder`, schemas/tools.py).
Every id is derived (the message's from the response id, a call's from the
request id and its index), so a response reads the same wherever it is
built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.tool_calls import ToolCallReader

__all__ = ["OutputBuilder", "Step", "call_item", "message_id", "message_item",
           "output_text_part", "output_items"]


def message_id(response_id: str) -> str:
    """The id of a response's output message, derived from the response's id."""
    return "msg_" + response_id.removeprefix("resp_")


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None
                     ) -> dict[str, Any]:
    """An output text part; ``logprobs`` its tokens' (OpenAI's shape), when asked for."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(response_id: str, text: str | None,
                 status: Literal["in_progress", "completed", "incomplete"],
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The assistant's output message; ``text`` None: the message has no content yet."""
    return {"type": "message", "id": message_id(response_id), "status": status,
            "role": "assistant",
            "content": [] if text is None else [output_text_part(text, logprobs)]}


def call_item(call_id: str, name: str, arguments: str,
              status: Literal["in_progress", "completed", "incomplete"]) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


@dataclass
class Step:
    """What one piece of an answer read for calls did to the output: opened an
    item, added ``text`` to it (a message's text, a call's arguments), or
    closed it."""

    kind: Literal["open", "add", "close"]
    index: int
    text: str = ""


@dataclass
class OutputBuilder:
    """The output items of an answer read for function calls, built as its text
    comes (a stream) or all at once (:func:`response_object`), alike."""

    response_id: str
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: int | None = None

    def __post_init__(self) -> None:
        self._reader = ToolCallReader(self.response_id.removeprefix("resp_"))

    def feed(self, text: str) -> list[Step]:
        return self._steps(self._reader.feed(text))

    def finish(self) -> list[Step]:
        """The end of the answer: what the reader held back, the open item
        closed, and an empty message when there was nothing at all."""
        steps = self._steps(self._reader.finish())
        if not self.items:
            steps += self._open_message()
        steps += self._close()
        return steps

    def _steps(self, events: list[Any]) -> list[Step]:
        steps: list[Step] = []
        for event in events:
            if event.kind == "content":
                current = self.items[self._open] if self._open is not None else None
                if current is None or current["type"] != "message":
                    steps += self._close() + self._open_message()
                assert self._open is not None
                self.items[self._open]["content"][0]["text"] += event.text
                steps.append(Step("add", self._open, event.text))
            elif event.kind == "call":
                steps += self._close()
                self.items.append(call_item(event.id, event.name, "", "in_progress"))
                self._open = len(self.items) - 1
                steps.append(Step("open", self._open))
            else:
                assert self._open is not None
                self.items[self._open]["arguments"] += event.text
                steps.append(Step("add", self._open, event.text))
        return steps

    def _open_message(self) -> list[Step]:
        messages = sum(1 for item in self.items if item["type"] == "message")
        item = message_item(self.response_id, "", "in_progress")
        if messages:
            item["id"] = f"{item['id']}_{messages}"
        self.items.append(item)
        self._open = len(self.items) - 1
        return [Step("open", self._open)]

    def _close(self) -> list[Step]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        self.items[index]["status"] = "completed"
        return [Step("close", index)]

    def output(self, status: Literal["in_progress", "completed", "incomplete"]
               ) -> list[dict[str, Any]]:
        """The items, each in ``status``."""
        return [{**item, "status": status} for item in self.items]


def output_items(response_id: str, text: str, reads_calls: bool,
                 status: Literal["in_progress", "completed", "incomplete"],
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The output of a response whose answer is ``text``: its message (with its
    tokens' ``logprobs`` when asked for), or with function tools the items read
    from it."""
    if not reads_calls:
        return [message_item(response_id, text, status, logprobs)]
    built = OutputBuilder(response_id)
    built.feed(text)
    built.finish()
    return built.output(status)

"""The events of a streamed response, in OpenAI's order, ``sequence_number`` from 0:
one :class:`ResponseEvents` per stream builds each as a dict (function calls
open their items as the text shows them); a failure after the stream began is
``response.failed`` alone. :func:`frame` writes one as SSE."""

from __future__ import annotations

from typing import Any

from gateway import sse
from gateway.responses.objects import response_object
from schemas.openai.logprobs import chat_logprobs
from schemas.openai.response_items import (
    OutputBuilder,
    Step,
    message_id,
    message_item,
    output_text_part,
)
from schemas.openai.responses import ResponsesRequest
from schemas.records import ErrorInfo, TokenLogprob, Usage

__all__ = ["ResponseEvents", "frame"]


def frame(event: dict[str, Any]) -> bytes:
    """One event as SSE: ``event: <type>`` and its JSON as ``data:``."""
    return sse.json_data(event, event=str(event["type"]))


class ResponseEvents:
    """The event builder of one streamed response."""

    def __init__(self, response_id: str, created_at: int, body: ResponsesRequest) -> None:
        self.response_id = response_id
        self.created_at = created_at
        self.body = body
        self.item_id = message_id(response_id)
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # the tokens', when asked for
        self.sequence = 0
        self.ended = False
        # an answer read for function calls: its items, built as they come
        self.items = OutputBuilder(response_id) if body.reads_calls() else None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        if self.ended:
            raise RuntimeError(f"response {self.response_id} already ended; no {kind}")
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _part(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self._event(kind, item_id=self.item_id, output_index=0, content_index=0,
                           **fields)

    def opening(self) -> list[dict[str, Any]]:
        """The response is created and in progress, with an empty message to fill."""
        started = response_object(self.response_id, self.created_at, self.body, "in_progress")
        events = [self._event("response.created", response=started),
                  self._event("response.in_progress", response=started)]
        if self.items is not None:  # the items open as the answer shows them
            return events
        return [
            *events,
            self._event("response.output_item.added", output_index=0,
                        item=message_item(self.response_id, None, "in_progress")),
            self._part("response.content_part.added", part=output_text_part("")),
        ]

    def delta(self, text: str, tokens: list[TokenLogprob] | None = None
              ) -> list[dict[str, Any]]:
        """The next piece of text (none for an empty piece), with its tokens'
        log probabilities when they were asked for."""
        logprobs = chat_logprobs(tokens)["content"] if tokens else []
        self.logprobs.extend(logprobs)
        if not text:
            return []
        self.text.append(text)
        if self.items is not None:
            return self._item_events(self.items.feed(text))
        return [self._part("response.output_text.delta", delta=text, logprobs=logprobs)]

    def _item_events(self, steps: list[Step]) -> list[dict[str, Any]]:
        """The events of the output items' steps (an answer read for calls)."""
        assert self.items is not None
        events: list[dict[str, Any]] = []
        for step in steps:
            item = self.items.items[step.index]
            where = {"item_id": item["id"], "output_index": step.index}
            message = item["type"] == "message"
            if step.kind == "open":
                shown = {**item, "content": []} if message else item
                events.append(self._event("response.output_item.added",
                                          output_index=step.index, item=dict(shown)))
                if message:
                    events.append(self._event("response.content_part.added", **where,
                                              content_index=0, part=output_text_part("")))
            elif step.kind == "add" and message:
                events.append(self._event("response.output_text.delta", **where,
                                          content_index=0, delta=step.text, logprobs=[]))
            elif step.kind == "add":
                events.append(self._event("response.function_call_arguments.delta", **where,
                                          delta=step.text))
            elif message:
                text = item["content"][0]["text"]
                events += [self._event("response.output_text.done", **where, content_index=0,
                                       text=text, logprobs=[]),
                           self._event("response.content_part.done", **where, content_index=0,
                                       part=output_text_part(text)),
                           self._event("response.output_item.done", output_index=step.index,
                                       item=dict(item))]
            else:
                events += [self._event("response.function_call_arguments.done", **where,
                                       name=item["name"], arguments=item["arguments"]),
                           self._event("response.output_item.done", output_index=step.index,
                                       item=dict(item))]
        return events

    def closing(self, finish_reason: str | None, usage: Usage | None,
                completed_at: int) -> list[dict[str, Any]]:
        """The text is whole: close the part and the message, then the response,
        ``response.completed`` or, when the output budget ran out,
        ``response.incomplete``."""
        text = "".join(self.text)
        final = response_object(self.response_id, self.created_at, self.body, "completed",
                                 text=text, usage=usage, finish_reason=finish_reason,
                                 completed_at=completed_at,
                                 logprobs=self.logprobs if self.body.logprobs_asked()[0]
                                 else None)
        if self.items is not None:
            events = self._item_events(self.items.finish())
            events.append(self._event(f"response.{final['status']}", response=final))
            self.ended = True
            return events
        events = [
            self._part("response.output_text.done", text=text, logprobs=self.logprobs),
            self._part("response.content_part.done",
                       part=output_text_part(text, self.logprobs)),
            self._event("response.output_item.done", output_index=0, item=final["output"][0]),
            self._event(f"response.{final['status']}", response=final),
        ]
        self.ended = True
        return events

    def failure(self, error: ErrorInfo) -> list[dict[str, Any]]:
        """The response failed after its stream began."""
        failed = response_object(self.response_id, self.created_at, self.body, "failed",
                                 text="".join(self.text), error=error)
        events = [self._event("response.failed", response=failed)]
        self.ended = True
        return events

"""The Response object of OpenAI's Responses API, built in one pure function so it
reads the same in the create call, the stream and a read back. ``completed``
with ``length`` is ``incomplete``; ``error`` keeps ``rate_limit_exceeded``,
else ``server_error``. And a response's input items, as ``input_items`` lists
them."""

from __future__ import annotations

import uuid
from typing import Any, Literal, get_args

from schemas.images import text_pieces
from schemas.openai.response_items import output_items, output_text_part
from schemas.openai.responses import ResponsesRequest, response_usage
from schemas.records import ErrorInfo, Message, Usage

__all__ = ["ResponseStatus", "new_response_id", "response_object", "is_stored", "input_items",
           "item_page"]

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed",
                         "cancelled"]

_ERROR_CODES = frozenset({"rate_limit_exceeded"})


def new_response_id(request_id: str | None = None) -> str:
    """``resp_`` and hex: the pipeline's request id where there is one, so that a
    response can be found in the log by its id."""
    return f"resp_{request_id or uuid.uuid4().hex}"


def _error_object(error: ErrorInfo | None) -> dict[str, Any] | None:
    if error is None:
        return None
    code = error["code"] if error["code"] in _ERROR_CODES else "server_error"
    return {"code": code, "message": error["message"]}


def _message_status(status: ResponseStatus) -> Literal["in_progress", "completed",
                                                       "incomplete"]:
    if status in ("queued", "in_progress"):
        return "in_progress"
    return "completed" if status == "completed" else "incomplete"


def is_stored(body: ResponsesRequest) -> bool:
    """Whether the response is kept to be read again: OpenAI stores unless told
    ``store: false`` (which a background response cannot be)."""
    return bool(body.background) or body.store is not False


def response_object(response_id: str, created_at: int, body: ResponsesRequest,
                    status: ResponseStatus, text: str | None = None,
                    usage: Usage | None = None, finish_reason: str | None = None,
                    error: ErrorInfo | None = None,
                    completed_at: int | None = None,
                    logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Response object of ``body`` in ``status``; ``text`` None leaves ``output``
    empty, any text is the output message."""
    if status not in get_args(ResponseStatus):
        raise ValueError(f"unknown response status {status!r}")
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    output = [] if text is None else output_items(response_id, text, body.reads_calls(),
                                                  _message_status(status), logprobs)
    tools, tool_choice, parallel = body.tools_echo()
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": completed_at if status == "completed" else None,
        "background": bool(body.background),
        "error": _error_object(error) if status == "failed" else None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "model": body.model,
        "output": output,
        "parallel_tool_calls": parallel,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": is_stored(body),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": body.text.format.echo() if body.text and body.text.format
                 else {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": tools,
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else response_usage(usage),
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "metadata": dict(body.metadata or {}),
    }


def input_items(request_id: str, turns: list[Message]) -> list[dict[str, Any]]:
    """A response's own input (not its instructions, not the conversation it
    continued) as OpenAI lists it, oldest first: messages, the function calls
    an assistant turn sent back, and the calls' outputs. Each id is derived
    from the request id and the item's place, so a list reads the same on
    every replica."""
    items: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        if turn["role"] == "tool":
            items.append({"id": f"fco_{request_id}_{i}", "type": "function_call_output",
                          "call_id": turn["tool_call_id"], "output": turn["content"],
                          "status": "completed"})
            continue
        if turn["role"] != "assistant":
            items.append({"id": f"msg_{request_id}_{i}", "type": "message",
                          "role": turn["role"], "status": "completed",
                          "content": _input_parts(turn)})
            continue
        if turn["content"] or not turn["tool_calls"]:
            items.append({"id": f"msg_{request_id}_{i}", "type": "message",
                          "role": "assistant", "status": "completed",
                          "content": [output_text_part(turn["content"])]})
        items += [{"id": f"fc_{request_id}_{i}_{j}", "type": "function_call",
                   "call_id": call["id"], "name": call["name"],
                   "arguments": call["arguments"], "status": "completed"}
                  for j, call in enumerate(turn["tool_calls"] or ())]
    return items


def item_page(items: list[dict[str, Any]], *, limit: int, order: Literal["asc", "desc"],
              after: str | None) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as OpenAI's list: ``order``, then
    those after the item ``after`` names (an id not among them: none)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def _input_parts(turn: Message) -> list[dict[str, Any]]:
    """A turn's text, and its images (by their file in the store) where they stood."""
    text, refs = turn["content"], turn.get("images") or ()
    if not refs:
        return [{"type": "input_text", "text": text}]
    pieces = text_pieces(text, refs)
    parts: list[dict[str, Any]] = []
    for piece, ref in zip(pieces, refs, strict=False):
        if piece:
            parts.append({"type": "input_text", "text": piece})
        parts.append({"type": "input_image", "file_id": ref["file_id"], "image_url": None,
                      "detail": ref.get("detail") or "auto"})
    if pieces[-1]:
        parts.append({"type": "input_text", "text": pieces[-1]})
    return parts

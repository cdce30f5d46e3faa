"""The objects of Anthropic's Messages API that Conveyor answers with: the
Message of a whole answer, its ``usage``, its ``stop_reason``, and the error
body (``{"type": "error", "error": {"type", "message"}}``) with the status
Anthropic gives each kind of failure (docs/api/messages.md#errors)."""

from __future__ import annotations

import json
from typing import Any

from gateway.messages.protocol import tool_use_id
from schemas.records import Usage

__all__ = ["message_id", "message_object", "usage_object", "stop_reason", "error_of",
           "OVERLOADED_STATUS"]

# Anthropic's status for an overloaded service (the SDK's OverloadedError)
OVERLOADED_STATUS = 529

# an HTTP status as Anthropic's error type (and the status it is sent with)
_BY_STATUS: dict[int, tuple[str, int]] = {
    400: ("invalid_request_error", 400),
    401: ("authentication_error", 401),
    402: ("billing_error", 402),
    403: ("permission_error", 403),
    404: ("not_found_error", 404),
    405: ("invalid_request_error", 405),
    408: ("timeout_error", 408),
    409: ("conflict_error", 409),
    413: ("request_too_large", 413),
    415: ("invalid_request_error", 415),
    422: ("invalid_request_error", 400),
    429: ("rate_limit_error", 429),
    500: ("api_error", 500),
    502: ("api_error", 502),
    503: ("overloaded_error", OVERLOADED_STATUS),
    504: ("timeout_error", 504),
    529: ("overloaded_error", OVERLOADED_STATUS),
}


def message_id(request_id: str) -> str:
    """A Message's id: ``msg_`` and the pipeline's request id (what inspect knows)."""
    return f"msg_{request_id}"


def usage_object(usage: Usage | None) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` are those the prefix cache did not
    hold, ``cache_read_input_tokens`` those it did (their sum is the prompt)."""
    prompt = usage["prompt_tokens"] if usage else 0
    cached = (usage.get("cached_tokens") or 0) if usage else 0
    return {"input_tokens": prompt - cached, "output_tokens":
            usage["completion_tokens"] if usage else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(finish_reason: str | None, stops: list[str]) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of an answer that ended with the
    pipeline's ``finish_reason``. The engines end at a stop sequence without
    saying which: with ``stop_sequences`` given, an end that was not the length,
    a tool call or the content filter reads as ``stop_sequence``, named when
    only one was given (docs/api/messages.md#stop-sequences)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "content_filter":
        return "refusal", None
    if stops:
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return "end_turn", None


def message_object(request_id: str, model: str, text: str | None,
                   tool_calls: list[dict[str, Any]], finish_reason: str | None,
                   usage: Usage | None, stops: list[str]) -> dict[str, Any]:
    """The Message of a whole answer: a text block (when there is text), then a
    ``tool_use`` block for each call."""
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    for call in tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                        "name": call["function"]["name"],
                        "input": _arguments(call["function"]["arguments"])})
    reason, sequence = stop_reason(finish_reason, stops)
    return {"id": message_id(request_id), "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage_object(usage)}


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as ``input`` (postprocess checked they are an object)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_of(status: int, message: str, param: str | None = None,
             request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    """Anthropic's error for a failure of HTTP ``status``: the status it is sent
    with and its body (``{"type": "error", "error": {"type", "message"}}``); a
    ``param`` the message does not name leads it (``max_tokens: ...``)."""
    kind, sent = _BY_STATUS.get(status) or (
        ("invalid_request_error", status) if status < 500 else ("api_error", status))
    if param and param not in message:
        message = f"{param}: {message}"
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return sent, body

"""OpenAI's completion objects: the streaming chunks (assembled as JSON text)
and the whole answer, built here once for the gateway and for job results.

Chat requests get ``chat.completion.chunk`` objects, completions get
``text_completion`` objects; with ``stream_options.include_usage`` every
chunk carries ``"usage": null`` and a last chunk with empty choices carries
the usage, as OpenAI does.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.records import ChunkHeader, Usage

__all__ = ["completion_id", "delta_chunk", "usage_chunk", "full_response"]


def completion_id(header: ChunkHeader, request_id: str) -> str:
    prefix = "chatcmpl-" if header["kind"] == "chat" else "cmpl-"
    return prefix + request_id


def _base(header: ChunkHeader, request_id: str) -> dict[str, Any]:
    chat = header["kind"] == "chat"
    return {
        "id": completion_id(header, request_id),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": header["created"],
        "model": header["model"],
    }


def delta_chunk(
    header: ChunkHeader,
    request_id: str,
    text: str,
    finish_reason: str | None = None,
    role: bool = False,
) -> str:
    out = _base(header, request_id)
    choice: dict[str, Any]
    if header["kind"] == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if not role and (text or finish_reason is None):
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out["choices"] = [choice]
    if header["include_usage"]:
        out["usage"] = None
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def usage_chunk(header: ChunkHeader, request_id: str, usage: Usage) -> str:
    out = _base(header, request_id)
    out["choices"] = []
    out["usage"] = {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def full_response(kind: str, model: str, created: int, request_id: str, text: str,
                  finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
    """The unstreamed answer: a ``chat.completion`` or a ``text_completion``."""
    prompt = usage["prompt_tokens"] if usage else 0
    completion = usage["completion_tokens"] if usage else 0
    usage_out = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
    if kind == "chat":
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_out,
        }
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage_out,
    }

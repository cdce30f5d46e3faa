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

__all__ = ["completion_id", "delta_chunk", "usage_chunk", "usage_object", "full_response"]


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


def usage_object(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` of a chat completion or completion: the counts, their total,
    and how many prompt tokens the engine's prefix cache held."""
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
    }


def usage_chunk(header: ChunkHeader, request_id: str, usage: Usage) -> str:
    out = _base(header, request_id)
    out["choices"] = []
    out["usage"] = usage_object(usage)
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def full_response(kind: str, model: str, created: int, request_id: str, text: str,
                  finish_reason: str | None, usage: Usage | None) -> dict[str, Any]:
    """The unstreamed answer: a ``chat.completion`` or a ``text_completion``."""
    usage_out = usage_object(usage or Usage(prompt_tokens=0, completion_tokens=0))
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

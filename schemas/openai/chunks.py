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

import orjson

from schemas.openai.logprobs import chat_logprobs, completion_logprobs
from schemas.records import ChunkHeader, TokenLogprob, Usage
from schemas.tool_calls import read_tool_calls

__all__ = ["compact_json", "completion_id", "delta_chunk", "tool_call_chunk", "usage_chunk",
           "usage_object", "full_response"]


def completion_id(header: ChunkHeader, request_id: str) -> str:
    prefix = "chatcmpl-" if header["kind"] == "chat" else "cmpl-"
    return prefix + request_id


def _chunk(header: ChunkHeader, request_id: str, choices: list[dict[str, Any]],
           usage: Usage | None = None) -> str:
    """One chunk as JSON text; with ``include_usage`` every chunk carries a usage."""
    chat = header["kind"] == "chat"
    out: dict[str, Any] = {"id": completion_id(header, request_id),
                           "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": header["created"], "model": header["model"],
                           "choices": choices}
    if header["include_usage"]:
        out["usage"] = None if usage is None else usage_object(usage)
    return compact_json(out)


def compact_json(obj: Any) -> str:
    """``obj`` as compact JSON text, non-ASCII kept: orjson's (a chunk a stream a
    token window, written at postprocess), json's for text orjson refuses (a lone
    surrogate, which the wire then carries as "?")."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def delta_chunk(
    header: ChunkHeader,
    request_id: str,
    text: str,
    finish_reason: str | None = None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> str:
    """A chunk of text (or the role, or the finish); ``logprobs`` is the
    object of its tokens (schemas/openai/logprobs.py) when they were asked for."""
    choice: dict[str, Any]
    if header["kind"] == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if not role and (text or (finish_reason is None and logprobs is None)):
            delta["content"] = text  # (a chunk of logprobs alone has an empty delta)
        choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    return _chunk(header, request_id, [choice])


def tool_call_chunk(header: ChunkHeader, request_id: str, index: int, arguments: str,
                    call_id: str | None = None, name: str | None = None) -> str:
    """A chat chunk with one ``tool_calls`` delta: a call's start (its id, type
    and name, with empty arguments) or more of its arguments, as OpenAI
    streams them."""
    call: dict[str, Any] = {"index": index}
    if call_id is not None:
        call.update(id=call_id, type="function", function={"name": name, "arguments": arguments})
    else:
        call["function"] = {"arguments": arguments}
    return _chunk(header, request_id, [{"index": 0, "delta": {"tool_calls": [call]},
                                        "logprobs": None, "finish_reason": None}])


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
    """The last chunk of a stream asked for its usage: no choices, the usage."""
    return _chunk({**header, "include_usage": True}, request_id, [], usage)


def full_response(kind: str, model: str, created: int, request_id: str, text: str,
                  finish_reason: str | None, usage: Usage | None,
                  tool_calls: bool = False,
                  logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    """The unstreamed answer: a ``chat.completion`` or a ``text_completion``.
    With ``tool_calls`` the text is read for calls (schemas/tools.py): the
    message carries them, and an answer that made one finished with
    ``tool_calls``. ``logprobs`` (None: not asked for) are the answer's tokens'."""
    chat = kind == "chat"
    choice: dict[str, Any] = {"index": 0}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            read = read_tool_calls(request_id, text)
            message["content"] = read.content
            if read.tool_calls:
                message["tool_calls"] = read.tool_calls
                finish_reason = "tool_calls" if finish_reason in ("stop", "tool_calls") \
                    else finish_reason
        choice.update(message=message,
                      logprobs=None if logprobs is None else chat_logprobs(logprobs))
    else:
        choice.update(text=text, logprobs=None if logprobs is None
                      else completion_logprobs(logprobs, 0))
    choice["finish_reason"] = finish_reason
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice],
            "usage": usage_object(usage or Usage(prompt_tokens=0, completion_tokens=0))}

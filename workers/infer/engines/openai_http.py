"""An engine that forwards to an OpenAI-compatible HTTP upstream (vLLM, SGLang,
llama.cpp's server); why each choice: docs/decisions/0020-the-http-engine.md.

* One ``aiohttp.ClientSession`` of ``capacity`` keep-alive connections, idle
  at most 4 s; 600 s bound connecting and each wait for the next chunk. A
  request whose pooled connection the upstream closed before answering is
  sent again, once.
* A rendered ``prompt_text`` (or any completion) goes to ``/v1/completions``
  with the continuation appended; a chat without one to
  ``/v1/chat/completions``, a continuation as a final assistant message
  (``continue_final_message``). Streamed with ``include_usage``.
* The text deltas of one socket read are one :class:`Piece`; the final piece
  carries the finish reason (anything but ``"length"`` is ``"stop"``) and the
  difference to the upstream's ``usage.completion_tokens`` (never negative).
* An HTTP status >= 400, an error event, a transport failure, unparsable data
  or a stream without a finish reason is an EngineError with the upstream's
  message. Closing the generator early closes the connection.
* The request's ``cache_salt`` goes in the body (``cache_salt=False``,
  ``--no-upstream-cache-salt``: none, for an upstream refusing unknown fields).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Literal

import aiohttp
import numpy as np
import orjson

from conveyor.errors import EngineError, InvalidRequest
from schemas.records import Message, ResponseFormat, TokenLogprob, TopLogprob
from schemas.structured import wire_format
from schemas.tool_calls import CLOSE, OPEN
from workers.infer.engines.base import (
    EmbeddingRequest,
    Engine,
    GenerationRequest,
    Piece,
    message_parts,
)

__all__ = ["OpenAIHttpEngine"]

# an upstream's statuses that refuse the request's body: the client's error
_REFUSALS = frozenset({400, 413, 422})

log = logging.getLogger(__name__)

_KEEPALIVE_S = 4.0
_TIMEOUT_S = 600.0


class OpenAIHttpEngine(Engine):
    """Generates through an OpenAI-compatible server at ``base_url``."""

    name = "openai"
    # response_format, tools and logit_bias passed on (the upstream's calls written
    # as text), logprobs asked of the upstream and read back from its chunks
    constrains_output = decodes_tools = biases_logits = reports_logprobs = True
    # an embedding model's requests go to the upstream's /v1/embeddings as they are
    embeds = True
    # images go as the data URLs of OpenAI's image_url parts
    sees_images = True

    def __init__(self, base_url: str, capacity: int = 64, cache_salt: bool = True,
                 api_key: str = "") -> None:
        self.capacity = capacity
        self.base_url = base_url.rstrip("/")
        self.cache_salt = cache_salt  # send the request's salt (see the module notes)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the shared connection pool (no request is made)."""
        if self._client is not None:
            return
        self._client = aiohttp.ClientSession(
            base_url=self.base_url + "/",
            # idle connections closed before an upstream's own keep-alive ends them
            # (uvicorn's and so vLLM's: 5 s), never reused as the upstream closes them
            connector=aiohttp.TCPConnector(limit=self.capacity,
                                           keepalive_timeout=_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, connect=_TIMEOUT_S, sock_read=_TIMEOUT_S),
            json_serialize=json.dumps,
            headers=self._headers,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream one answer from the upstream (see the module notes)."""
        client = self._client
        if client is None:
            raise EngineError(f"engine {self.name} is not started")
        path, body = _upstream_body(request)
        if self.cache_salt and request.cache_salt:  # vLLM refuses an empty one
            body["cache_salt"] = request.cache_salt
        chat = path.endswith("/chat/completions")
        reading = _Reading(chat, request.logprobs)
        try:
            async with await _posted(client, path.lstrip("/"), body) as response:
                if response.status >= 400:
                    raise EngineError(
                        f"upstream returned HTTP {response.status}: "
                        f"{await _error_message(response)}"
                    )
                partial = b""
                async for block in response.content.iter_any():
                    *lines, partial = (partial + block).split(b"\n")
                    piece = reading.take(lines)
                    if piece is not None:
                        yield piece
                piece = reading.take([partial])  # a last line with no newline
                if piece is not None:
                    yield piece
                if not reading.done:
                    response.close()  # the stream ended without [DONE]: do not reuse
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"upstream {self.base_url} failed: {exc!r}") from exc
        if reading.finish is None:
            raise EngineError("upstream stream ended without a finish_reason")
        extra = 0 if reading.usage_tokens is None else max(
            0, reading.usage_tokens - reading.emitted)
        yield Piece("", tokens=extra, finish_reason=reading.finish)

    async def embed(self, request: EmbeddingRequest) -> np.ndarray:
        """The upstream's vectors (asked for as base64: float32 bytes), in the
        inputs' order. The upstream's refusal of the body (400, 413, 422) is the
        client's (its message and param); any other status, or an answer that
        is not JSON, is the engine's failure (another worker may take it)."""
        client = self._client
        if client is None:
            raise EngineError(f"engine {self.name} is not started")
        body: dict[str, Any] = {"model": request.upstream_model or request.model,
                                "input": [i if isinstance(i, str) else list(i)
                                          for i in request.inputs],
                                "encoding_format": "base64"}
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        try:
            async with await _posted(client, "v1/embeddings", body) as response:
                if response.status in _REFUSALS:
                    error = await _error_object(response)
                    raise InvalidRequest(f"The upstream refused the request: "
                                         f"{error.get('message')}", param=error.get("param"))
                if response.status >= 400:
                    raise EngineError(f"upstream returned HTTP {response.status}: "
                                      f"{await _error_message(response)}")
                raw = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"upstream {self.base_url} failed: {exc!r}") from exc
        try:
            data = sorted(json.loads(raw)["data"], key=lambda d: d["index"])
            vectors = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                                if isinstance(d["embedding"], str)
                                else np.asarray(d["embedding"], "<f4") for d in data])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"upstream {self.base_url} answered no embeddings: "
                              f"{exc!r}") from exc
        if len(vectors) != len(request.inputs):
            raise EngineError(f"upstream {self.base_url} answered {len(vectors)} vectors "
                              f"for {len(request.inputs)} inputs")
        return vectors

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


async def _posted(client: aiohttp.ClientSession, path: str,
                  body: dict[str, Any]) -> aiohttp.ClientResponse:
    """The upstream's response to ``body``; sent again, once, when the pooled
    connection it went out on was closed before any answer came (the upstream
    ended it as it sat idle): the upstream answered nothing, the client saw
    nothing."""
    try:
        return await client.post(path, json=body)
    except aiohttp.ClientConnectorError:
        raise  # no connection was made: nothing to send again on
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        log.info("upstream closed a pooled connection (%r): sending again", exc)
        return await client.post(path, json=body)


class _Reading:
    """One answer's SSE events, read a block at a time: the text deltas that
    came in one read are one :class:`Piece` (see the module notes)."""

    def __init__(self, chat: bool, logprobs: bool) -> None:
        self.chat = chat
        self.logprobs = logprobs
        self.calls = CallsAsText()  # an upstream's tool calls, in Conveyor's format
        self.done = False
        self.emitted = 0
        self.finish: Literal["stop", "length"] | None = None
        self.usage_tokens: int | None = None

    def take(self, lines: list[bytes]) -> Piece | None:
        """The text of ``lines`` (complete SSE lines) as one piece, or None."""
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        for raw in lines:
            if self.done or not raw.startswith(b"data:"):
                continue  # blank separators, comments, event names, the tail
            data = raw[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            event = _parse(data)
            if "error" in event:
                raise EngineError(f"upstream error: {_message_of(event)}")
            usage = event.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                self.usage_tokens = int(usage["completion_tokens"])
            for choice in event.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                if self.chat:
                    delta = choice.get("delta") or {}
                    text = (delta.get("content") or "") + self.calls.feed(
                        delta.get("tool_calls"))
                    if choice.get("finish_reason"):
                        text += self.calls.close()
                else:
                    text = choice.get("text")
                if text:
                    texts.append(text)
                    if self.logprobs:
                        logprobs.extend(_logprobs(choice.get("logprobs"), self.chat))
                reason = choice.get("finish_reason")
                if reason:
                    self.finish = "length" if reason == "length" else "stop"
        if not texts:
            return None
        self.emitted += len(texts)
        return Piece("".join(texts), tokens=len(texts), logprobs=tuple(logprobs))


def _upstream_body(request: GenerationRequest) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body an upstream gets for ``request``."""
    body: dict[str, Any] = {
        "model": request.upstream_model or request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    if request.stop:
        body["stop"] = list(request.stop)
    if request.presence_penalty:
        body["presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        body["frequency_penalty"] = request.frequency_penalty
    if request.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in request.logit_bias}
    if request.logprobs and request.rendered is None:
        body["logprobs"], body["top_logprobs"] = True, request.top_logprobs
    elif request.logprobs:
        body["logprobs"] = request.top_logprobs
    if request.response_format is not None and request.response_format["type"] == "tool_calls":
        body.update(wire_tools(request.response_format))
    elif request.response_format is not None:  # vLLM and SGLang take it on both endpoints
        body["response_format"] = wire_format(request.response_format)
    if request.rendered is not None:
        body["prompt"] = request.rendered
        return "/v1/completions", body
    messages: list[dict[str, Any]] = []
    for m in request.messages:
        message: dict[str, Any] = {"role": m["role"], "content": _content(m, request.images)}
        if m.get("name"):
            message["name"] = m["name"]
        if m.get("tool_calls"):
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"] or ()]
        if m.get("tool_call_id"):
            message["tool_call_id"] = m["tool_call_id"]
        messages.append(message)
    if request.continuation:
        messages.append({"role": "assistant", "content": request.continuation})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    body["messages"] = messages
    return "/v1/chat/completions", body


def _content(m: Message, images: Mapping[str, bytes]) -> str | list[dict[str, Any]]:
    """A message's content: its text, or with images its parts, each image a data URL."""
    if not m.get("images"):
        return m["content"]
    out: list[dict[str, Any]] = []
    for part in message_parts(m, images):
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
            continue
        url = f"data:{part.media_type};base64,{base64.b64encode(part.data).decode('ascii')}"
        image: dict[str, Any] = {"url": url}
        if part.detail != "auto":
            image["detail"] = part.detail
        out.append({"type": "image_url", "image_url": image})
    return out


def _parse(data: bytes) -> dict[str, Any]:
    try:
        # orjson: several times json's speed (docs/decisions/0020-the-http-engine.md)
        event = orjson.loads(data)
    except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
        raise EngineError(f"upstream sent unparsable data: {data[:200]!r}") from exc
    if not isinstance(event, dict):
        raise EngineError(f"upstream sent unexpected data: {data[:200]!r}")
    return event


async def _error_object(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """OpenAI's error object of a refusal (its message and param), or the text."""
    text = await response.text(errors="replace")
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return error
    return {"message": text[:500] or response.reason or "", "param": None}


async def _error_message(response: aiohttp.ClientResponse) -> str:
    text = await response.text(errors="replace")
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:500] or (response.reason or "")
    if isinstance(payload, dict):
        return _message_of(payload)
    return str(payload)[:500]


def _message_of(payload: dict[str, Any]) -> str:
    """The message of OpenAI's envelope, or of the common variants."""
    error = payload.get("error", payload)
    if isinstance(error, dict):
        for key in ("message", "detail"):
            if error.get(key):
                return str(error[key])
    if isinstance(error, str):
        return error
    return json.dumps(payload)[:500]


def _logprobs(data: Any, chat: bool) -> tuple[TokenLogprob, ...]:
    """An upstream chunk's log probabilities (chat's ``content`` entries, or the
    legacy completions' parallel lists) as Conveyor's."""
    if not isinstance(data, dict):
        return ()
    if chat:
        return tuple(TokenLogprob(
            token=e["token"], bytes=_bytes(e), logprob=float(e["logprob"]),
            top=[TopLogprob(token=t["token"], bytes=_bytes(t), logprob=float(t["logprob"]))
                 for t in e.get("top_logprobs") or ()]) for e in data.get("content") or ())
    tops = data.get("top_logprobs") or []
    out = []
    for i, (token, logprob) in enumerate(zip(data.get("tokens") or (),
                                             data.get("token_logprobs") or (), strict=False)):
        best = sorted((tops[i] or {}).items(), key=lambda kv: -kv[1]) if i < len(tops) else []
        out.append(TokenLogprob(token=token, bytes=token.encode(), logprob=float(logprob),
                                top=[TopLogprob(token=t, bytes=t.encode(), logprob=float(lp))
                                     for t, lp in best]))
    return tuple(out)


def _bytes(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    return bytes(raw) if isinstance(raw, list) else str(entry["token"]).encode()


def wire_tools(fmt: ResponseFormat) -> dict[str, Any]:
    """A request's tools (a ``tool_calls`` format) in OpenAI's shape, for an
    upstream that calls functions itself."""
    tools = json.loads(fmt["schema"])
    choice: Any = tools["choice"]
    if choice == "function":
        choice = {"type": "function", "function": {"name": tools["function"]}}
    functions = [{"type": "function", "function": {
        "name": f["name"], "description": f["description"],
        "parameters": json.loads(f["parameters"]) if f["parameters"] else {
            "type": "object", "properties": {}}, "strict": f["strict"]}}
        for f in tools["functions"]]
    return {"tools": functions, "tool_choice": choice,
            "parallel_tool_calls": tools["parallel"]}


class CallsAsText:
    """An upstream's streamed ``tool_calls`` deltas written as the text of
    Conveyor's tool-call format (schemas/tools.py), which postprocess and the
    gateway read back into calls (with Conveyor's ids): a call's head when its
    name comes, its arguments as they come, its end when the next call or the
    finish comes."""

    def __init__(self) -> None:
        self.index: int | None = None

    def feed(self, deltas: Any) -> str:
        out = ""
        for delta in deltas or ():
            function = delta.get("function") or {}
            index = delta.get("index", 0)
            if index != self.index:
                between = "\n" if self.index is not None else ""
                out += self.close() + between
                self.index = index
                out += f'{OPEN}\n{{"name": {json.dumps(function.get("name") or "")}, ' \
                       '"arguments": '
            out += function.get("arguments") or ""
        return out

    def close(self) -> str:
        """The end of the open call, if any."""
        if self.index is None:
            return ""
        self.index = None
        return f"}}\n{CLOSE}"

"""A tiny real OpenAI-compatible upstream for the HTTP engine's tests.

A Starlette app served by uvicorn on 127.0.0.1 (a free port) in its own
thread and event loop. It streams SSE the way vLLM does (``data: {...}``
events, a usage event with empty ``choices``, ``data: [DONE]``) and records
every request it gets, including whether the client went away mid-stream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class UpstreamCall:
    path: str
    body: dict[str, Any]
    client_port: int
    authorization: str | None = None  # the request's Authorization header
    sent: int = 0  # text events written so far
    finished: bool = False  # the whole stream went out
    disconnected: bool = False  # the client left before the end


@dataclass
class FakeUpstream:
    """The upstream's behaviour (set by a test) and what it received."""

    base_url: str
    answer_tokens: int = 5  # tokens before a natural "stop"
    token_delay_s: float = 0.0
    status: int = 200  # anything else: answer with OpenAI's error envelope
    usage_extra: int = 0  # completion_tokens reported beyond the events sent
    garbage: str | None = None  # a data line sent after the first token, as it is
    burst: bool = False  # the whole answer in one write (an unpaced upstream's burst)
    calls: list[UpstreamCall] = field(default_factory=list)

    def reset(self) -> None:
        self.answer_tokens, self.token_delay_s = 5, 0.0
        self.status, self.usage_extra, self.garbage, self.burst = 200, 0, None, False
        self.calls.clear()

    def wait_for(self, predicate: Any, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return False


def _app(upstream: FakeUpstream) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        call = UpstreamCall(request.url.path, body, request.client.port if request.client else 0,
                            request.headers.get("authorization"))
        upstream.calls.append(call)
        if upstream.status != 200:
            envelope = {"error": {"message": "bad request from the fake",
                                  "type": "invalid_request_error", "param": None, "code": None}}
            return JSONResponse(envelope, status_code=upstream.status)
        events = _events(upstream, call)
        if upstream.burst:
            whole = "".join([e async for e in events])

            async def one_write() -> AsyncIterator[str]:
                yield whole

            events = one_write()
        return StreamingResponse(events, media_type="text/event-stream")

    async def embeddings(request: Request) -> Response:
        """Input i's vector is (i, 1, 0, 0), base64 or float as asked."""
        body = await request.json()
        upstream.calls.append(UpstreamCall(request.url.path, body, 0, None))
        if upstream.status != 200:
            envelope = {"error": {"message": "input too long for the fake",
                                  "type": "invalid_request_error", "param": "input",
                                  "code": None}}
            return JSONResponse(envelope, status_code=upstream.status)
        vectors = [np.asarray([i, 1, 0, 0], "<f4") for i in range(len(body["input"]))]
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.tobytes()).decode()
                 if body.get("encoding_format") == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data[::-1], "model": body["model"],
                             "usage": {"prompt_tokens": 3, "total_tokens": 3}})

    return Starlette(routes=[
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ])


async def _events(upstream: FakeUpstream, call: UpstreamCall) -> AsyncIterator[str]:
    chat = call.path.endswith("/chat/completions")
    n = min(call.body["max_tokens"], upstream.answer_tokens)
    finish = "length" if call.body["max_tokens"] < upstream.answer_tokens else "stop"

    asked = call.body.get("logprobs")

    def event(text: str | None, reason: str | None = None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            if asked and text:  # as vLLM: the token, then the likeliest (the token first)
                top = [{"token": text, "logprob": -0.25, "bytes": list(text.encode())},
                       {"token": "other", "logprob": -2.0, "bytes": None}]
                choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top[
                    :call.body.get("top_logprobs") or 0]}]}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason}
            if asked is not None and text:
                choice["logprobs"] = {"tokens": [text], "token_logprobs": [-0.25],
                                      "top_logprobs": [dict(list({
                                          text: -0.25, "other": -2.0}.items())[:asked])],
                                      "text_offset": [0]}
        return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

    tools = call.body.get("tools")
    try:
        if chat and tools:  # two calls of the first function, as vLLM streams them
            name = tools[0]["function"]["name"]
            for i, city in enumerate(("Paris", "Rome")):
                for delta in ({"index": i, "id": f"up-{i}", "type": "function",
                               "function": {"name": name, "arguments": ""}},
                              {"index": i, "function": {"arguments": '{"city": '}},
                              {"index": i, "function": {"arguments": f'"{city}"}}'}}):
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {
                        "tool_calls": [delta]}, "finish_reason": None}]}) + "\n\n"
            yield event(None, "tool_calls")
            yield "data: [DONE]\n\n"
            call.finished = True
            return
        if chat:  # vLLM opens with a role-only delta
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"},
                                                      "finish_reason": None}]}) + "\n\n"
        for i in range(n):
            if upstream.token_delay_s:
                await asyncio.sleep(upstream.token_delay_s)
            yield event(f"tok{i} ")
            call.sent += 1
            if i == 0 and upstream.garbage is not None:
                yield f"data: {upstream.garbage}\n\n"
        yield event(None, finish)
        usage = {"prompt_tokens": 3, "completion_tokens": n + upstream.usage_extra,
                 "total_tokens": 3 + n + upstream.usage_extra}
        yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
        call.finished = True
    finally:
        call.disconnected = not call.finished


@pytest.fixture(scope="session")
def _upstream_server() -> Iterator[FakeUpstream]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    upstream = FakeUpstream(base_url=f"http://127.0.0.1:{port}")
    server = uvicorn.Server(uvicorn.Config(_app(upstream), lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not upstream.wait_for(lambda: server.started, timeout_s=10):
        raise RuntimeError("the fake upstream did not start")
    yield upstream
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def fake_upstream(_upstream_server: FakeUpstream) -> FakeUpstream:
    """The running fake upstream, reset to its default behaviour."""
    _upstream_server.reset()
    return _upstream_server

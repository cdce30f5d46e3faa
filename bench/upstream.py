"""A fast OpenAI-compatible upstream, streaming only: the engine the pipeline
benchmarks put behind Conveyor, so that what they measure is the pipeline.

What it serves and how it paces: docs/benchmarks/index.md. The n-th token is
due ``n * delay`` after the request arrived, so sleep overshoot does not
accumulate; the delay travels in the model name, since an HTTP engine
forwards the model but no custom header.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["build_app", "main"]

Kind = Literal["completion", "chat"]

_TOKEN = " tok"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_ROUTES: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(obj: object) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


@dataclass(frozen=True)
class _Job:
    """One parsed request: what to emit and how fast."""

    kind: Kind
    model: str
    n_tokens: int
    finish_reason: Literal["length", "stop"]
    delay_s: float
    include_usage: bool
    prompt_tokens: int

    @classmethod
    def parse(cls, kind: Kind, body: dict[str, Any], tokens: int, delay_s: float) -> _Job:
        """``tokens`` at most, ``delay_s`` apart unless the model says (``bench@10``:
        10 ms); the prompt's tokens about four characters each, as Conveyor's
        ``estimate`` tokenizer counts them."""
        model = str(body.get("model", "bench"))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = int(limit) if limit is not None else None
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        n_tokens = tokens if max_tokens is None else min(tokens, max_tokens)
        _, paced, ms = model.rpartition("@")
        if kind == "chat":
            text = "".join(str(m.get("content", "")) for m in body.get("messages", []))
        else:
            prompt = body.get("prompt", "")
            text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        return cls(kind, model, n_tokens, "length" if n_tokens == max_tokens else "stop",
                   max(0.0, float(ms) / 1000.0) if paced else delay_s,
                   bool((body.get("stream_options") or {}).get("include_usage", False)),
                   max(1, len(text) // 4))

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.n_tokens,
                "total_tokens": self.prompt_tokens + self.n_tokens}

    def head(self) -> dict[str, Any]:
        """What every chunk begins with."""
        chat = self.kind == "chat"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model}

    def choice(self, delta: dict[str, str], text: str, finish: str | None) -> dict[str, Any]:
        """A chat's choice holds ``delta``, a completion's ``text``."""
        if self.kind == "chat":
            return {"index": 0, "delta": delta, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError("client went away")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: str, kind: str) -> None:
    envelope = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    await _respond(send, status, _JSON_HEADERS, _dumps(envelope))


async def _stream(send: Send, job: _Job, start: float) -> None:
    """The SSE frames, each encoded once; unpaced, all in one body."""
    head = job.head()

    def chunk(delta: dict[str, str], text: str, finish: str | None) -> bytes:
        return _sse({**head, "choices": [job.choice(delta, text, finish)]})

    first = chunk({"role": "assistant", "content": _TOKEN}, _TOKEN, None)
    token = chunk({"content": _TOKEN}, _TOKEN, None)
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    parts: list[bytes] = []
    for step in range(1, job.n_tokens + 1):
        frame = first if step == 1 and job.kind == "chat" else token
        if job.delay_s <= 0:
            parts.append(frame)
            continue
        wait = start + step * job.delay_s - time.perf_counter()  # until token ``step`` is due
        if wait > 0:
            await asyncio.sleep(wait)
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    parts.append(chunk({}, "", job.finish_reason))
    if job.include_usage:
        parts.append(_sse({**head, "choices": [], "usage": job.usage()}))
    parts.append(b"data: [DONE]\n\n")
    await send({"type": "http.response.body", "body": b"".join(parts)})


def build_app(tokens: int, delay_s: float) -> ASGIApp:
    """The upstream: ``tokens`` tokens a request at most, ``delay_s`` between them
    unless the model name says otherwise (``bench@<ms>``)."""
    if tokens < 1:
        raise ValueError("tokens must be at least 1")
    models = _dumps({"object": "list", "data": [
        {"id": "bench", "object": "model", "owned_by": "bench"}]})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # no lifespan: uvicorn runs it with lifespan="off"
            return
        start = time.perf_counter()
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/v1/models":
            await _respond(send, 200, _JSON_HEADERS, models)
            return
        kind = _ROUTES.get(path)
        if kind is None:
            await _error(send, 404, f"no route {method} {path}", "not_found_error")
            return
        if method != "POST":
            await _error(send, 405, f"{path} takes POST", "invalid_request_error")
            return
        try:
            body = json.loads(await _read_body(receive))
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            job = _Job.parse(kind, body, tokens, delay_s)
        except ConnectionAbortedError:
            return
        except (ValueError, TypeError) as exc:
            await _error(send, 400, str(exc), "invalid_request_error")
            return
        await _stream(send, job, start)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream",
                                     description="A fast OpenAI-compatible upstream.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--tokens", type=int, default=32, help="tokens a request at most")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="default pacing per token")
    args = parser.parse_args(argv)

    import uvicorn

    uvicorn.run(build_app(args.tokens, args.delay_ms / 1000.0), host=args.host, port=args.port,
                loop="uvloop", http="httptools", log_level="warning", access_log=False,
                lifespan="off")


if __name__ == "__main__":
    main()

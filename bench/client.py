"""The load generator: one streamed completion, timed (TTFT at the first chunk
with text, total at ``data: [DONE]``), over a lean HTTP/1.1 client of its own
(why not httpx: docs/benchmarks/index.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import orjson

from bench.harness import BenchError

__all__ = ["Answer", "HttpError", "Sample", "SseSink", "StreamClient", "first_success",
           "stream_completion"]


@dataclass(frozen=True)
class Sample:
    """One request: seconds to the first text chunk and to ``[DONE]``, and the
    answer (its text, and its completion tokens where the usage said)."""

    ttft: float
    total: float
    chars: int
    error: str | None = None
    text: str = ""
    tokens: int = 0
    gaps: tuple[float, ...] = ()  # seconds between successive chunks with text

    @property
    def ok(self) -> bool:
        return self.error is None


class HttpError(Exception):
    """The connection or the response broke HTTP/1.1 (or closed early)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: what arrived waits in :attr:`buf`."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports do not derive from asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def fill(self) -> None:
        """Wait for more bytes; HttpError once the peer has closed."""
        if self.closed:
            raise HttpError("the server closed the connection")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def until(self, sep: bytes) -> bytes:
        """The bytes before ``sep``, taken from the buffer with it."""
        while (at := self.buf.find(sep)) < 0:
            await self.fill()
        out = bytes(self.buf[:at])
        del self.buf[:at + len(sep)]
        return out

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self.fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


@dataclass
class _Head:
    status: int
    headers: dict[str, str]


async def _head(conn: _Connection) -> _Head:
    lines = (await conn.until(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return _Head(int(parts[1]), headers)


async def _body(conn: _Connection, head: _Head) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive, the chunked encoding undone."""
    if "chunked" in head.headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await conn.until(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await conn.until(b"\r\n"):  # trailers, then the blank line
                    pass
                return
            yield await conn.exactly(size)
            await conn.exactly(2)
    else:  # the servers measured give a length when they do not chunk
        left = int(head.headers.get("content-length", "0"))
        while left > 0:
            if not conn.buf:
                await conn.fill()
            piece = bytes(conn.buf[:left])
            del conn.buf[:len(piece)]
            left -= len(piece)
            yield piece


class StreamClient:
    """HTTP/1.1 with keep-alive and room for ``connections`` concurrent streams
    (an async context manager; plain ``http://`` URLs)."""

    def __init__(self, connections: int = 64, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.headers: dict[str, str] = {}  # sent with every request (an API key)
        self._slots = asyncio.Semaphore(connections)
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _connect(self, host: str, port: int) -> _Connection:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(_Connection, host, port)
        return conn

    def _release(self, host: str, port: int, conn: _Connection, reusable: bool) -> None:
        if reusable and not conn.closed and not conn.buf:
            conn.used = True
            self._idle.setdefault((host, port), []).append(conn)
        else:
            conn.close()

    async def post_sse(self, url: str, body: Mapping[str, Any], sink: SseSink,
                       headers: Mapping[str, str] | None = None) -> None:
        """POST ``body`` as JSON to ``url`` (``headers`` added to the client's) and
        feed each SSE ``data:`` payload of the answer to ``sink`` until it says it
        is done, or the whole body of an answer other than 200 (HttpError,
        TimeoutError or ValueError on failure)."""
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        payload = orjson.dumps(body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in {**self.headers, **(headers or {})}.items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                   f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                   f"Content-Length: {len(payload)}\r\n{extra}\r\n").encode() + payload
        async with self._slots, asyncio.timeout(self.timeout_s):
            conn, head = await self._send(host, port, request)
            reusable = False
            try:
                sink.code = head.status
                pending, done = b"", False
                async for piece in _body(conn, head):
                    if done:
                        continue  # read to the end, so the connection is reusable
                    if head.status != 200:
                        pending += piece  # the error's body, whole
                        continue
                    *lines, pending = (pending + piece).split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:") and sink.data(line[5:].strip()):
                            done = True
                            break
                if head.status != 200:
                    sink.error_body(pending)
                reusable = head.headers.get("connection", "").lower() != "close"
            finally:
                self._release(host, port, conn, reusable)

    async def _send(self, host: str, port: int, request: bytes) -> tuple[_Connection, _Head]:
        """Write ``request`` and read the answer's head. A kept-alive connection
        the server closed while it was idle, before answering, is replaced once."""
        for attempt in (0, 1):
            conn = await self._connect(host, port)
            reused = conn.used
            try:
                assert conn.transport is not None
                conn.transport.write(request)
                return conn, await _head(conn)
            except HttpError:
                conn.close()
                if not (reused and attempt == 0 and not conn.buf):
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")


class SseSink(Protocol):
    """What :meth:`StreamClient.post_sse` feeds an answer to."""

    code: int  # the answer's HTTP status

    def data(self, data: bytes) -> bool:
        """One event's payload; True once the sink wants no more."""

    def error_body(self, body: bytes) -> None:
        """The body of an answer other than 200."""


@dataclass
class Answer:
    """One streamed answer as its client saw it (a :class:`SseSink` that reads every
    event): when each came, the text, every id, final chunk and usage, ``[DONE]``
    and what came after it, or the error."""

    start: float = field(default_factory=time.monotonic)
    code: int = 0  # the answer's HTTP status
    events: list[float] = field(default_factory=list)  # arrival of each data event
    text_at: list[float] = field(default_factory=list)  # arrival of each with text
    text: str = ""
    ids: set[str] = field(default_factory=set)
    finish_reasons: list[str] = field(default_factory=list)
    usages: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0  # data: [DONE] seen
    after_done: int = 0  # data events after [DONE]
    error: str | None = None
    # http (a status other than 200), event (an error event in the stream); the
    # chaos load adds cut (no [DONE]), hang (past its deadline) and transport
    error_kind: str | None = None
    error_code: str | None = None  # the OpenAI error's code, else its type

    def data(self, data: bytes) -> bool:
        now = time.monotonic()
        self.events.append(now)
        if self.done:
            self.after_done += 1
            return False
        if data == b"[DONE]":
            self.done += 1
            return False
        chunk = orjson.loads(data)
        if "error" in chunk:
            self.error_kind, self.error_code = "event", _error_code(chunk["error"])
            self.error = f"error event: {orjson.dumps(chunk['error']).decode()[:300]}"
            return False
        if isinstance(cid := chunk.get("id"), str):
            self.ids.add(cid)
        text = ""
        for choice in chunk.get("choices") or ():
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason") is not None:
                self.finish_reasons.append(choice["finish_reason"])
        if text:
            self.text += text
            self.text_at.append(now)
        if chunk.get("usage"):
            self.usages.append(chunk["usage"])
        return False

    def error_body(self, body: bytes) -> None:
        self.error_kind = "http"
        self.error = f"HTTP {self.code}: {body.decode(errors='replace')[:300]}"
        with contextlib.suppress(ValueError, KeyError, TypeError):
            self.error_code = _error_code(orjson.loads(body)["error"])

    def sample(self) -> Sample:
        """Timed: an error, no ``[DONE]`` or no text is a failed sample."""
        if self.error is not None:
            return _failed(self.start, self.error)
        if not self.done or not self.text_at:
            return _failed(self.start, "no text in the stream" if self.done
                           else "stream ended without [DONE]")
        at = self.text_at
        tokens = int(self.usages[-1].get("completion_tokens") or 0) if self.usages else 0
        return Sample(ttft=at[0] - self.start, total=time.monotonic() - self.start,
                      chars=len(self.text), text=self.text, tokens=tokens,
                      gaps=tuple(b - a for a, b in zip(at, at[1:], strict=False)))


def _error_code(error: Any) -> str | None:
    """An OpenAI error object's code, else its type."""
    if not isinstance(error, dict):
        return None
    code = error.get("code") or error.get("type")
    return str(code) if code is not None else None


async def stream_completion(client: StreamClient, url: str, body: dict[str, Any]) -> Sample:
    """POST a streaming request and time it; failures come back as a Sample with
    ``error`` set, never raised."""
    answer = Answer()
    try:
        await client.post_sse(url, body, answer)
    except (HttpError, OSError, TimeoutError, ValueError) as exc:
        return _failed(answer.start, f"{type(exc).__name__}: {exc}"[:200])
    return answer.sample()


def _failed(start: float, error: str) -> Sample:
    elapsed = time.monotonic() - start
    return Sample(ttft=elapsed, total=elapsed, chars=0, error=error)


async def first_success(name: str, attempt: Callable[[], Awaitable[Sample]],
                        timeout_s: float) -> None:
    """Until ``attempt`` answers (a pipeline's first request can fail while its
    consumers join their groups); BenchError naming the last error past
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        sample = await attempt()
        if sample.ok:
            return
        last = sample.error or ""
        await asyncio.sleep(0.5)
    raise BenchError(f"{name}: no successful request within {timeout_s:.0f} s: {last}")

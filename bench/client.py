"""The benchmark's HTTP client: one streamed completion, timed.

SSE is parsed by lines; time to first token (TTFT) is taken at the first chunk
that carries text, total latency at ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["Sample", "make_client", "stream_completion"]


@dataclass(frozen=True)
class Sample:
    """One request: seconds to the first text chunk and to ``[DONE]``."""

    ttft: float
    total: float
    chars: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def make_client(connections: int = 64, timeout_s: float = 30.0) -> httpx.AsyncClient:
    """HTTP/1.1 with keep-alive and room for ``connections`` concurrent streams."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=httpx.Timeout(timeout_s, connect=5.0),
    )


def _text_of(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    """POST a streaming request and time it; failures come back as a Sample with
    ``error`` set, never raised."""
    start = time.perf_counter()
    first: float | None = None
    chars = 0
    done = False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:200].decode(errors="replace")
                return _failed(start, f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return _failed(start, f"error event: {json.dumps(chunk['error'])[:200]}")
                text = _text_of(chunk)
                if text:
                    if first is None:
                        first = time.perf_counter()
                    chars += len(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return _failed(start, f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    if not done:
        return _failed(start, "stream ended without [DONE]")
    if first is None:
        return _failed(start, "no text in the stream")
    return Sample(ttft=first - start, total=end - start, chars=chars)


def _failed(start: float, error: str) -> Sample:
    elapsed = time.perf_counter() - start
    return Sample(ttft=elapsed, total=elapsed, chars=0, error=error)

"""The chaos run's load: a few clients, each sending streamed chat requests one
after another, every one of them recorded whole.

A client sends a ``traceparent`` of its own, so its trace id finds the
request's events in the log even when the answer never named the request id
(an error before the first chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from topics.envelope import new_traceparent

__all__ = ["PROMPTS", "Load", "Record"]

PROMPTS = [
    "Describe a lighthouse at night in a few sentences.",
    "Explain how a bicycle gear works to a child.",
    "Write a short story about a robot who learns to bake bread.",
    "List some reasons why people keep a diary, with a sentence on each.",
    "Tell me about the water cycle.",
    "Give advice to someone starting to learn the piano.",
    "What makes a good breakfast? Answer in a paragraph.",
    "Describe a busy train station in the morning.",
]


@dataclass
class Record:
    """One request as its client saw it."""

    client: int
    number: int
    prompt: int
    max_tokens: int
    trace_id: str
    started: float  # time.monotonic()
    ended: float | None = None
    request_id: str | None = None
    ids: set[str] = field(default_factory=set)
    events: list[float] = field(default_factory=list)  # arrival of each SSE data event
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    usages: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0  # data: [DONE] seen
    after_done: int = 0  # data events after [DONE]
    error: str | None = None
    # http (a status other than 200), event (an error event in the stream),
    # cut (the stream ended without [DONE] or an error), hang (past the deadline),
    # transport (the connection failed)
    error_kind: str | None = None
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return self.done > 0 and bool(self.finish_reasons)

    def in_flight_at(self, t: float) -> bool:
        return self.started < t and (self.ended is None or self.ended > t)

    def longest_gap(self, until: float) -> float:
        """The longest wait between consecutive events of the stream, from its
        start to its end (or ``until`` when it never ended)."""
        marks = [self.started, *self.events, self.ended if self.ended is not None else until]
        return max(b - a for a, b in zip(marks, marks[1:], strict=False))


@dataclass
class Load:
    """``clients`` concurrent clients sending requests until told to stop, or
    until ``max_requests`` were sent in all."""

    base_url: str
    clients: int
    max_tokens: int
    max_requests: int
    client_deadline_s: float
    model: str = "smollm2"
    seed: int = 7
    records: list[Record] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=self.clients * 2),
            timeout=httpx.Timeout(self.client_deadline_s, connect=5.0))
        self._tasks = [asyncio.create_task(self._lane(i)) for i in range(self.clients)]

    def stop(self) -> None:
        """No new requests; those in flight run to their end or deadline."""
        self._stop.set()

    def abort(self) -> None:
        """Stop every client now, requests in flight included."""
        self._stop.set()
        for task in self._tasks:
            task.cancel()

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    @property
    def exhausted(self) -> bool:
        return len(self.records) >= self.max_requests

    def in_flight(self) -> list[Record]:
        return [r for r in self.records if r.ended is None]

    def streaming(self) -> list[Record]:
        """Requests in flight that already received text."""
        return [r for r in self.in_flight() if r.text]

    async def _lane(self, client: int) -> None:
        number = 0
        while not self._stop.is_set() and not self.exhausted:
            prompt = (client + number * self.clients) % len(PROMPTS)
            traceparent = new_traceparent()
            trace_id = traceparent.split("-")[1]
            record = Record(client, number, prompt, self.max_tokens, trace_id, time.monotonic())
            self.records.append(record)
            try:
                await asyncio.wait_for(self._one(record, traceparent), self.client_deadline_s)
            except TimeoutError:
                record.error_kind, record.error = "hang", (
                    f"no answer and no error within {self.client_deadline_s:.0f} s")
            except (httpx.HTTPError, OSError) as exc:
                record.error_kind, record.error = "transport", f"{type(exc).__name__}: {exc}"
            record.ended = time.monotonic()
            number += 1
            if record.error_kind in ("transport", "http"):
                await asyncio.sleep(0.5)  # the gateway refused or is gone: do not spin

    def body(self, prompt: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": PROMPTS[prompt]}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "seed": self.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def _one(self, record: Record, traceparent: str) -> None:
        url = f"{self.base_url}/v1/chat/completions"
        headers = {"traceparent": traceparent}
        async with self._client.stream("POST", url, json=self.body(record.prompt),
                                       headers=headers) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                record.error_kind = "http"
                record.error = f"HTTP {response.status_code}: {raw[:300]}"
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record.error_code = _error_code(json.loads(raw)["error"])
                return
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    _take(record, line[5:].strip())
        if record.error is None and not record.done:
            record.error_kind, record.error = "cut", "the stream ended without [DONE]"


def _take(record: Record, data: str) -> None:
    record.events.append(time.monotonic())
    if record.done:
        record.after_done += 1
        return
    if data == "[DONE]":
        record.done += 1
        return
    chunk = json.loads(data)
    if "error" in chunk:
        record.error_kind = "event"
        record.error = f"error event: {json.dumps(chunk['error'])[:300]}"
        record.error_code = _error_code(chunk["error"])
        return
    cid = chunk.get("id")
    if isinstance(cid, str):
        record.ids.add(cid)
        if record.request_id is None:
            record.request_id = cid.removeprefix("chatcmpl-")
    for choice in chunk.get("choices") or ():
        record.text += (choice.get("delta") or {}).get("content") or ""
        if choice.get("finish_reason") is not None:
            record.finish_reasons.append(choice["finish_reason"])
    if chunk.get("usage"):
        record.usages.append(chunk["usage"])


def _error_code(error: Any) -> str | None:
    """An OpenAI error object's code, else its type."""
    if not isinstance(error, dict):
        return None
    code = error.get("code") or error.get("type")
    return str(code) if code is not None else None

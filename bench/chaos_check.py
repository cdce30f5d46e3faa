"""The chaos run's clients and judge: a few clients, each sending streamed chat
requests one after another, every one of them recorded whole; then each
request's answer rebuilt from ``conveyor.tokens`` by the rule postprocess
answers with (:class:`workers.chunk_order.ChunkOrder`), whether its client got
that, once, and the outcomes (docs/benchmarks/index.md).

A client sends a ``traceparent`` of its own, so its trace id finds the
request's events in the log even when the answer never named the request id
(an error before the first chunk). A fault's stall is each stream in flight
when it struck's longest wait between consecutive events.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.client import Answer, HttpError, StreamClient
from bench.stats import fmt, markdown_table, percentile
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import TokenChunk
from topics.catalog import TOKENS
from topics.envelope import new_traceparent
from topics.follow import follow, snapshot
from topics.tracing import trace_id_of
from workers.chunk_order import ChunkOrder

__all__ = ["PROMPTS", "WORKER_STALL_TARGET_S", "Injected", "Load", "Logged", "Outcome", "Record",
           "Report", "Verdict", "judge", "read_tokens"]


@dataclass
class Injected:
    """A fault, when it struck and when it was undone."""

    name: str
    injected_at: float
    restored_at: float = 0.0
    notes: list[str] = field(default_factory=list)


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


@dataclass(kw_only=True)
class Record(Answer):
    """One request of the load as its client saw it."""

    client: int
    number: int
    prompt: int
    max_tokens: int
    trace_id: str
    ended: float | None = None  # time.monotonic()
    request_id: str | None = None  # its answer's id, else found in the log by its trace id

    def data(self, data: bytes) -> bool:
        super().data(data)
        if self.request_id is None and self.ids:
            self.request_id = next(iter(self.ids)).removeprefix("chatcmpl-")
        return False

    @property
    def finished(self) -> bool:
        return self.done > 0 and bool(self.finish_reasons)

    def in_flight_at(self, t: float) -> bool:
        return self.start < t and (self.ended is None or self.ended > t)

    def longest_gap(self, until: float) -> float:
        """The longest wait between consecutive events of the stream, from its
        start to its end (or ``until`` when it never ended)."""
        marks = [self.start, *self.events, self.ended if self.ended is not None else until]
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
        self._client = StreamClient(self.clients * 2, timeout_s=self.client_deadline_s)
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
            record = Record(client=client, number=number, prompt=prompt,
                            max_tokens=self.max_tokens, trace_id=trace_id)
            self.records.append(record)
            try:
                await asyncio.wait_for(self._client.post_sse(
                    f"{self.base_url}/v1/chat/completions", self.body(prompt), record,
                    {"traceparent": traceparent}), self.client_deadline_s)
                if record.error is None and not record.done:
                    record.error_kind, record.error = "cut", "the stream ended without [DONE]"
            except TimeoutError:
                record.error_kind, record.error = "hang", (
                    f"no answer and no error within {self.client_deadline_s:.0f} s")
            except (HttpError, OSError) as exc:
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


Outcome = Literal["answered", "errored", "lost", "duplicated", "corrupted"]


@dataclass
class Logged:
    """One request's chunks in ``conveyor.tokens``, in log order."""

    request_id: str
    trace_id: str = ""
    chunks: list[TokenChunk] = field(default_factory=list)

    def rebuilt(self) -> tuple[str, int, str | None, bool]:
        """(text, completion tokens, finish reason or ``error``, finished) as
        postprocess assembles them (:class:`ChunkOrder`)."""
        order = ChunkOrder()
        tokens = 0
        text: list[str] = []
        for chunk in self.chunks:
            for c in order.offer(chunk):
                if c["error"] is not None:
                    return "".join(text), tokens, "error", True
                text.append(c["text"])
                tokens += c["tokens"]
                if c["finish_reason"] is not None:
                    return "".join(text), tokens, c["finish_reason"], True
        return "".join(text), tokens, None, False

    def conflicts(self) -> list[int]:
        """Sequence numbers one run wrote twice with different contents."""
        seen: dict[tuple[str, int], tuple[str, int, str | None]] = {}
        bad: set[int] = set()
        for c in self.chunks:
            key = (c["text"], c["tokens"], c["finish_reason"])
            if seen.setdefault((c.get("run_id", ""), c["seq"]), key) != key:
                bad.add(c["seq"])
        return sorted(bad)

    def runs(self) -> list[str]:
        """Who wrote the chunks, in order of first appearance: ``worker/run@start``."""
        return list(dict.fromkeys(f"{c['worker_id']}/{c.get('run_id', '')}@"
                                  f"{c.get('run_start', 0)}" for c in self.chunks))


async def read_tokens(settings: Settings) -> dict[str, Logged]:
    """Every chunk of ``conveyor.tokens`` written until now, by request id."""
    out: dict[str, Logged] = {}

    def add(chunk: TokenChunk) -> None:
        rid = chunk["envelope"]["request_id"]
        logged = out.setdefault(rid, Logged(rid))
        logged.trace_id = logged.trace_id or trace_id_of(chunk["envelope"])
        logged.chunks.append(chunk)

    every = range(TOKENS.partitions(settings.kafka))
    await snapshot(follow(settings, TOKENS, every, "beginning"), default_codec(), add, 600.0)
    return out


@dataclass
class Verdict:
    record: Record
    outcome: Outcome
    why: str = ""
    logged: Logged | None = None


def judge(records: list[Record], log: dict[str, Logged]) -> list[Verdict]:
    """One verdict per record, against the log."""
    by_trace = {lg.trace_id: lg for lg in log.values() if lg.trace_id}
    verdicts = []
    for r in records:
        logged = log.get(r.request_id or "") or by_trace.get(r.trace_id)
        if logged is not None and r.request_id is None:
            r.request_id = logged.request_id
        verdicts.append(Verdict(r, *_outcome(r, logged), logged))
    return verdicts


def _outcome(r: Record, logged: Logged | None) -> tuple[Outcome, str]:
    dup = _duplicated(r)
    if dup:
        return "duplicated", dup
    if r.error_kind in ("hang", "cut", "transport") and not r.finished:
        return "lost", r.error or r.error_kind or ""
    if r.error_kind in ("http", "event"):
        if r.finish_reasons:
            return "corrupted", f"an error after the final chunk: {r.error}"
        return "errored", r.error or ""
    if not r.finished:
        return "lost", "no final chunk"
    if logged is None:
        return "corrupted", "an answer the log does not hold"
    return _against_log(r, logged)


def _duplicated(r: Record) -> str:
    if len(r.finish_reasons) > 1:
        return f"{len(r.finish_reasons)} final chunks"
    if len(r.usages) > 1:
        return f"{len(r.usages)} usage chunks"
    if r.done > 1 or r.after_done:
        return f"{r.done} [DONE] and {r.after_done} events after it"
    if len(r.ids) > 1:
        return f"chunks of several completions: {sorted(r.ids)}"
    return ""


def _against_log(r: Record, logged: Logged) -> tuple[Outcome, str]:
    text, tokens, finish, finished = logged.rebuilt()
    conflicts = logged.conflicts()
    if r.text != text:
        head = text[:32]
        if head and r.text.count(head) > text.count(head):
            return "duplicated", f"text repeated ({len(r.text)} chars, log {len(text)})"
        at = len(os.path.commonprefix([r.text, text]))
        return "corrupted", (f"text differs from the log at char {at} "
                             f"({len(r.text)} vs {len(text)} chars; runs {logged.runs()})")
    if conflicts:
        return "corrupted", (f"the log holds different chunks for seq {conflicts[:5]} "
                             f"(runs {logged.runs()}): a restarted run spliced into the answer")
    if not finished:
        return "corrupted", "answered, but the log holds no final chunk"
    usage = r.usages[0] if r.usages else None
    if usage is None:
        return "corrupted", "no usage chunk (include_usage was asked for)"
    if usage.get("completion_tokens") != tokens:
        return "corrupted", (f"usage.completion_tokens {usage.get('completion_tokens')} but "
                             f"the log holds {tokens} tokens")
    reason = r.finish_reasons[0]
    if reason == "length" and tokens < r.max_tokens:
        return "corrupted", f"finish_reason length at {tokens} of {r.max_tokens} tokens"
    expected = finish if finish in ("stop", "length") else "stop"
    if reason != expected:
        return "corrupted", f"finish_reason {reason} but the log ends with {finish}"
    return "answered", ""


def by_fault(verdicts: list[Verdict], faults: list[tuple[str, float]]) -> dict[str, list[Verdict]]:
    """Each verdict under the first fault injected while its request was in flight,
    else the latest one injected before it started (its recovery), else baseline."""
    out: dict[str, list[Verdict]] = defaultdict(list)
    for v in verdicts:
        r = v.record
        hit = next((name for name, t in faults if r.in_flight_at(t)), None)
        if hit is None:
            before = [name for name, t in faults if t <= r.start]
            hit = before[-1] if before else "baseline"
        out[hit].append(v)
    return out


OUTCOMES = ("answered", "errored", "lost", "duplicated", "corrupted")
WORKER_STALL_TARGET_S = 3.0
_WORKER_FAULTS = ("worker", "worker-redis-down", "redis-flush-worker")


class Report:
    def __init__(self, verdicts: list[Verdict], injected: Sequence[Injected],
                 unexpected: Sequence[tuple[float, str, int]], skipped: Sequence[str]) -> None:
        self.verdicts = verdicts
        self.injected = list(injected)
        self.unexpected = list(unexpected)
        self.skipped = list(skipped)
        self.groups = by_fault(verdicts, [(e.name, e.injected_at) for e in self.injected])
        self.now = time.monotonic()

    def stalls(self, event: Injected) -> list[float]:
        return [v.record.longest_gap(self.now) for v in self.verdicts
                if v.record.in_flight_at(event.injected_at)]

    def counts(self, verdicts: Sequence[Verdict]) -> Counter[str]:
        return Counter(v.outcome for v in verdicts)

    def table(self) -> str:
        header = ["fault", "requests", *OUTCOMES, "in flight", "stall p50 s", "stall p99 s",
                  "stall max s"]
        rows = []
        names = ["baseline", *[e.name for e in self.injected]]
        for name in names:
            group = self.groups.get(name, [])
            c = self.counts(group)
            event = next((e for e in self.injected if e.name == name), None)
            stalls = self.stalls(event) if event is not None else []
            rows.append([name, str(len(group)), *(str(c[o]) for o in OUTCOMES),
                         str(len(stalls)) if event else "-", fmt(percentile(stalls, 50)),
                         fmt(percentile(stalls, 99)), fmt(max(stalls, default=float("nan")))])
        c = self.counts(self.verdicts)
        rows.append(["overall", str(len(self.verdicts)), *(str(c[o]) for o in OUTCOMES),
                     "", "", "", ""])
        return markdown_table(header, rows)

    def lines(self) -> list[str]:
        out = [self.table(), ""]
        for e in self.injected:
            back = f", undone after {e.restored_at - e.injected_at:.1f} s" if e.restored_at else ""
            notes = "; ".join(n for n in e.notes if not n.startswith("killed:"))
            out.append(f"{e.name}: {notes}{back}")
        for name in self.skipped:
            out.append(f"{name}: skipped (time or request limit reached)")
        starts = [(e.injected_at, e.name) for e in self.injected]
        for at, proc, code in self.unexpected:
            during = [n for t, n in starts if t <= at]
            out.append(f"UNEXPECTED EXIT: {proc} exited with code {code} "
                       f"(during {during[-1] if during else 'baseline'}); restarted")
        errors = Counter(f"{v.record.error_kind} {v.record.error_code or ''}".strip()
                         for v in self.verdicts if v.outcome == "errored")
        if errors:
            out.append("errors: " + ", ".join(f"{k} x{n}" for k, n in errors.most_common()))
        groups = {id(v): name for name, vs in self.groups.items() for v in vs}
        for v in (v for v in self.verdicts if v.outcome in ("lost", "duplicated", "corrupted")):
            r = v.record
            out.append(f"{v.outcome.upper()} [{groups[id(v)]}] request {r.request_id or '?'} "
                       f"(trace {r.trace_id}, client {r.client} #{r.number}): {v.why}")
        return out

    def verdict(self) -> tuple[bool, str]:
        c = self.counts(self.verdicts)
        bad = c["lost"] + c["duplicated"] + c["corrupted"]
        p99 = percentile([s for e in self.injected if e.name in _WORKER_FAULTS
                          for s in self.stalls(e)], 99)
        stall = ("worker stall p99 -" if p99 != p99 else
                 f"worker stall p99 {p99:.1f} s (target <= {WORKER_STALL_TARGET_S:g} s: "
                 f"{'met' if p99 <= WORKER_STALL_TARGET_S else 'MISSED'})")
        head = "PASS" if bad == 0 else "FAIL"
        return bad == 0, (
            f"chaos verdict: {head}: {len(self.verdicts)} requests, {c['answered']} answered, "
            f"{c['errored']} errored, {c['lost']} lost, {c['duplicated']} duplicated, "
            f"{c['corrupted']} corrupted; {stall}; "
            f"{len(self.unexpected)} unexpected process exits")

"""The chaos run's judge and report: what ``conveyor.tokens`` holds for each
request, whether what its client got is that, once, and what the run prints.

The log is read whole and each request's answer rebuilt from it by the rule
postprocess answers with (:class:`workers.chunk_order.ChunkOrder`), up to the
first chunk that finishes or fails; two chunks of one run with the same
``seq`` and different contents make a request corrupted even when the
client's text matches. Each request is answered, errored, lost, duplicated
or corrupted (what each means: docs/benchmarks/index.md).

:class:`Report` prints outcomes and stalls per fault, the failures one by
one, and a verdict line. A fault's stall is measured on the streams in flight
when it struck: each one's longest wait between consecutive events (start,
each SSE data event, end), p50 and p99 over them; a worker's SIGKILL should
stall its streams at most ``WORKER_STALL_TARGET_S`` at p99.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from bench.chaos_faults import Injected
from bench.chaos_load import Record
from bench.stats import markdown_table, percentile
from schemas.codec import default_codec
from topics.catalog import TOKENS
from workers.chunk_order import ChunkOrder

__all__ = ["Logged", "Outcome", "Verdict", "judge", "read_tokens", "WORKER_STALL_TARGET_S",
           "Report"]

Outcome = Literal["answered", "errored", "lost", "duplicated", "corrupted"]


@dataclass
class Logged:
    """One request's chunks in ``conveyor.tokens``, in log order."""

    request_id: str
    trace_id: str = ""
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def rebuilt(self) -> tuple[str, int, str | None, bool]:
        """(text, completion tokens, finish reason or ``error``, finished) as
        postprocess assembles them (:class:`ChunkOrder`)."""
        order = ChunkOrder()
        tokens = 0
        text: list[str] = []
        for chunk in self.chunks:
            for c in order.offer(chunk):  # type: ignore[arg-type]
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
        out: list[str] = []
        for c in self.chunks:
            tag = f"{c['worker_id']}/{c.get('run_id', '')}@{c.get('run_start', 0)}"
            if tag not in out:
                out.append(tag)
        return out


async def read_tokens(bootstrap: str, topic: str) -> dict[str, Logged]:
    """Every chunk of ``topic`` from the beginning to its end now, by request id."""
    codec = default_codec()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    parts = sorted(p["partition"] for d in described for p in d.get("partitions") or ())
    if not parts:
        raise RuntimeError(f"topic {topic} not found on {bootstrap}")
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest", request_timeout_ms=15000)
    await consumer.start()
    out: dict[str, Logged] = {}
    try:
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        left = {tp for tp in tps if ends[tp] > 0}
        while left:
            batch = await consumer.getmany(*left, timeout_ms=2000)
            for records in batch.values():
                for rec in records:
                    for chunk in TOKENS.unpack(codec, rec.value):
                        env = chunk["envelope"]
                        rid = env["request_id"]
                        logged = out.setdefault(rid, Logged(rid))
                        logged.trace_id = logged.trace_id or _trace_id(env["traceparent"])
                        logged.chunks.append(dict(chunk))
            for tp in list(left):
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()
    return out


def _trace_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 else ""


@dataclass
class Verdict:
    record: Record
    outcome: Outcome
    why: str = ""
    logged: Logged | None = None
    unlike_reference: bool = False


def judge(records: list[Record], log: dict[str, Logged],
          reference: dict[int, str]) -> list[Verdict]:
    """One verdict per record; ``reference`` is each prompt's answer before any fault
    (greedy decoding: a different text is shown, but is not by itself an error)."""
    by_trace = {lg.trace_id: lg for lg in log.values() if lg.trace_id}
    verdicts = []
    for r in records:
        logged = log.get(r.request_id or "") or by_trace.get(r.trace_id)
        if logged is not None and r.request_id is None:
            r.request_id = logged.request_id
        outcome, why = _outcome(r, logged)
        v = Verdict(r, outcome, why, logged)
        ref = reference.get(r.prompt)
        v.unlike_reference = outcome == "answered" and ref is not None and r.text != ref
        verdicts.append(v)
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
        return "corrupted", (f"text differs from the log at char {_diverge(r.text, text)} "
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


def _diverge(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def by_fault(verdicts: list[Verdict], faults: list[tuple[str, float]]) -> dict[str, list[Verdict]]:
    """Each verdict under the first fault injected while its request was in flight,
    else the latest one injected before it started (its recovery), else baseline."""
    out: dict[str, list[Verdict]] = defaultdict(list)
    for v in verdicts:
        r = v.record
        hit = next((name for name, t in faults if r.in_flight_at(t)), None)
        if hit is None:
            before = [name for name, t in faults if t <= r.started]
            hit = before[-1] if before else "baseline"
        out[hit].append(v)
    return out


OUTCOMES = ("answered", "errored", "lost", "duplicated", "corrupted")
WORKER_STALL_TARGET_S = 3.0
_WORKER_FAULTS = ("worker", "worker-redis-down", "redis-flush-worker")


def _s(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN: no stream in flight


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

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.outcome in ("lost", "duplicated", "corrupted")]

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
                         str(len(stalls)) if event else "-", _s(percentile(stalls, 50)),
                         _s(percentile(stalls, 99)), _s(max(stalls, default=float("nan")))])
        c = self.counts(self.verdicts)
        rows.append(["overall", str(len(self.verdicts)), *(str(c[o]) for o in OUTCOMES),
                     "", "", "", ""])
        return markdown_table(header, rows)

    def worker_stall_p99(self) -> float:
        stalls = [s for e in self.injected if e.name in _WORKER_FAULTS for s in self.stalls(e)]
        return percentile(stalls, 99)

    def calm(self) -> str:
        """Figures of the requests no fault struck while they ran, to read stalls against."""
        calm = [v.record for v in self.verdicts if v.outcome == "answered"
                and not any(v.record.in_flight_at(e.injected_at) for e in self.injected)]
        if not calm:
            return "no request ran without a fault"
        total = [r.ended - r.started for r in calm if r.ended is not None]
        ttft = [r.events[0] - r.started for r in calm if r.events]
        gaps = [r.longest_gap(self.now) for r in calm]
        return (f"requests no fault struck ({len(calm)}): duration p50 "
                f"{_s(percentile(total, 50))} s, TTFT p50 {_s(percentile(ttft, 50))} s, "
                f"longest gap p50 {_s(percentile(gaps, 50))} s, p99 {_s(percentile(gaps, 99))} s")

    def lines(self) -> list[str]:
        out = [self.table(), "", self.calm()]
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
        unlike = [v for v in self.verdicts if v.unlike_reference]
        if unlike:
            out.append(f"answers unlike their prompt's answer before any fault (greedy; shown, "
                       f"not counted): {len(unlike)}: "
                       + ", ".join(f"{v.record.request_id} (runs "
                                   f"{v.logged.runs() if v.logged else '?'})"
                                   for v in unlike[:10]))
        groups = {id(v): name for name, vs in self.groups.items() for v in vs}
        for v in self.verdicts:
            if v.outcome == "errored":
                r = v.record
                held = "no chunk in the log" if v.logged is None else (
                    f"{len(v.logged.chunks)} chunks in the log, runs {v.logged.runs()}")
                out.append(f"errored [{groups[id(v)]}] request {r.request_id or '?'} "
                           f"(trace {r.trace_id}): {(r.error or '')[:120]}; {held}")
        for v in self.failures():
            r = v.record
            out.append(f"{v.outcome.upper()} [{groups[id(v)]}] request {r.request_id or '?'} "
                       f"(trace {r.trace_id}, client {r.client} #{r.number}): {v.why}")
        return out

    def verdict(self) -> tuple[bool, str]:
        c = self.counts(self.verdicts)
        bad = c["lost"] + c["duplicated"] + c["corrupted"]
        p99 = self.worker_stall_p99()
        stall = ("worker stall p99 -" if p99 != p99 else
                 f"worker stall p99 {p99:.1f} s (target <= {WORKER_STALL_TARGET_S:g} s: "
                 f"{'met' if p99 <= WORKER_STALL_TARGET_S else 'MISSED'})")
        head = "PASS" if bad == 0 else "FAIL"
        return bad == 0, (
            f"chaos verdict: {head}: {len(self.verdicts)} requests, {c['answered']} answered, "
            f"{c['errored']} errored, {c['lost']} lost, {c['duplicated']} duplicated, "
            f"{c['corrupted']} corrupted; {stall}; "
            f"{len(self.unexpected)} unexpected process exits")

"""The chaos run's judge: what ``conveyor.tokens`` holds for each request, and
whether what its client got is that, once.

The log is read whole and each request's answer rebuilt from it by the rule
postprocess answers with (:class:`workers.chunk_order.ChunkOrder`), up to the
first chunk that finishes or fails; two chunks of one run with the same
``seq`` and different contents make a request corrupted even when the
client's text matches. Each request is answered, errored, lost, duplicated
or corrupted (what each means: docs/benchmarks/index.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from bench.chaos_load import Record
from schemas.codec import default_codec
from workers.chunk_order import ChunkOrder

__all__ = ["Logged", "Outcome", "Verdict", "judge", "read_tokens"]

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
                    chunk = codec.decode(rec.value, "TokenChunk")
                    env = chunk["envelope"]
                    rid = env["request_id"]
                    logged = out.setdefault(rid, Logged(rid))
                    logged.trace_id = logged.trace_id or _trace_id(env["traceparent"])
                    logged.chunks.append(chunk)
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

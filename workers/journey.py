"""One request's journey, read from the log: its events on every topic it
crossed, from its partitions and time window of each (:mod:`topics.lookup`),
never a scan, and the report ``conveyor inspect`` prints and the console shows
(content only when asked)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import SchemaError, last_line
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec, plain
from topics.catalog import (
    CONTROL,
    DLQ,
    INFER,
    PREPARED,
    REPLIES,
    REQUESTS,
    RESULTS,
    ROUTED,
    TOKENS,
    Topic,
    infer_topic,
)
from topics.envelope import iso, now_ms
from topics.lookup import KeyLookup, made_window
from topics.reader import Record, decoded
from workers.prompt_cache import CACHE_WORKER

__all__ = ["LAYERS", "Found", "Journey", "find_journey", "report"]

LAYERS = ("gateway", "preprocess", "route", "schedule", "infer", "postprocess")


@dataclass
class Found:
    """One event of the request: where it is, when it was written, what it says."""

    topic: str
    partition: int
    offset: int
    ts_ms: int
    record: Any = None
    error: str | None = None  # set when the value does not decode

    @property
    def where(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass
class Journey:
    request_id: str
    since_ms: int
    by_layer: dict[str, list[Found]] = field(default_factory=dict)
    chunks: list[Found] = field(default_factory=list)
    replies: list[Found] = field(default_factory=list)
    cancels: list[Found] = field(default_factory=list)
    letters: list[Found] = field(default_factory=list)
    read: list[dict[str, Any]] = field(default_factory=list)

    def events(self) -> list[Found]:
        return [f for fs in self.by_layer.values() for f in fs] + self.chunks + self.replies


def _decode(codec: Codec, records: list[Record], topic: Topic[Any],
            request_id: str | None = None) -> list[Found]:
    """The records as ``topic``'s events, in order (of a record of many
    requests' events, ``request_id``'s); an event a layer dead-letters is
    shown with its error, not fatal."""
    found: list[Found] = []

    def shown(r: Record, exc: SchemaError) -> None:
        found.append(Found(r.topic, r.partition, r.offset, r.timestamp,
                           error=f"{type(exc).__name__}: {exc}"))

    for record in records:
        found += [Found(r.topic, r.partition, r.offset, r.timestamp, event)
                  for r, event in decoded(topic, codec, [record], shown, request_id)]
    return found


async def find_journey(settings: Settings, request_id: str, since_ms: int,
                       codec: Codec | None = None, ended_ms: int | None = None
                       ) -> Journey | None:
    """Every event of ``request_id`` (None when its request is not in the log
    since ``since_ms``); see the module for what is read. ``ended_ms``: when
    the request is known to have ended (the request index's finish): its
    events are read up to then, not to its deadline, which for a request in a
    busy log is minutes of other requests' records."""
    codec = codec or default_codec()
    journey = Journey(request_id, since_ms)
    async with KeyLookup(settings) as look:
        first: list[Any] = []
        made = made_window(request_id, settings.process.clock_skew_ms, now_ms())
        if made is not None:  # the id says when: a few records, whatever --since says
            first = await look.find(REQUESTS.at(settings.kafka), request_id, *made, first=True)
        if not first:
            first = await look.find(REQUESTS.at(settings.kafka), request_id, since_ms, first=True)
        if not first:
            return None
        journey.by_layer["gateway"] = _decode(codec, first, REQUESTS)
        request = journey.by_layer["gateway"][0].record
        envelope = request["envelope"] if request else {}
        entered_ms = (envelope.get("stamps", {}).get("gateway", first[0].timestamp * 1000)
                      // 1000)
        skew = settings.process.clock_skew_ms
        start = entered_ms - skew
        until = max(envelope.get("deadline_ms") or 0,
                    entered_ms + int(settings.gateway.request_timeout_s * 1000)) + skew
        if ended_ms is not None:
            until = min(until, ended_ms + skew)

        async def read(topic: Topic, key: str | None = request_id, **kw: Any) -> list[Found]:
            """The request's events on ``topic``, decoded as the one type it carries."""
            found = await look.find(topic.at(settings.kafka), key, start, until, **kw)
            return _decode(codec, found, topic, request_id)

        journey.by_layer["preprocess"] = await read(PREPARED)
        journey.by_layer["route"] = await read(ROUTED)
        journey.chunks = await read(TOKENS)
        journey.cancels = await read(CONTROL)
        journey.letters = await read(DLQ)
        stamps = _stamps(journey.events())
        routed = [f.record for f in journey.by_layer["route"] if f.record]
        if routed:  # the task's partition is the worker's: every partition, a short window
            pool_topic = infer_topic(settings.kafka, routed[0]["route"]["pool"])
            lo = stamps.get("route", stamps.get("gateway", entered_ms * 1000)) // 1000 - skew
            hi = stamps["infer"] // 1000 + skew if "infer" in stamps else until
            tasks = await look.find(pool_topic, request_id, lo, hi,
                                    partitions=await look.partitions(pool_topic))
            journey.by_layer["schedule"] = _decode(codec, tasks, INFER)
        journey.by_layer["infer"] = journey.chunks[:1]
        if envelope.get("job_id"):
            results = await read(RESULTS, envelope["job_id"])
            journey.replies = [f for f in results
                               if f.record and f.record["request_id"] == request_id]
        elif envelope.get("reply_partition", -1) >= 0:
            journey.replies = await read(REPLIES,
                                         partitions=[envelope["reply_partition"]])
        journey.by_layer["postprocess"] = journey.replies[:1]
        journey.read = KeyLookup.describe(look.read)
    return journey


def _stamps(events: list[Found]) -> dict[str, int]:
    """Each layer's first stamp (µs) over every envelope seen."""
    out: dict[str, int] = {}
    for f in events:
        env = (f.record or {}).get("envelope") if isinstance(f.record, dict) else None
        for layer, us in (env or {}).get("stamps", {}).items():
            out[layer] = min(us, out.get(layer, us))
    return out


def report(journey: Journey, show_content: bool = False) -> dict[str, Any]:
    """The journey as a JSON-able dict (content only with ``show_content``)."""
    from workers.infer.progress import progress_of

    stamps = _stamps(journey.events())
    zero_us = stamps.get("gateway", min(stamps.values(), default=0))
    marks: list[tuple[str, int, str]] = []  # (label, µs, event)
    for layer in LAYERS:
        events = journey.by_layer.get(layer) or []
        if layer in stamps:
            marks.append((layer, stamps[layer], events[0].where if events else ""))
    chunks = [f.record for f in journey.chunks if f.record]
    if journey.chunks:
        marks.append(("first chunk", journey.chunks[0].ts_ms * 1000, journey.chunks[0].where))
    finals = [f for f in journey.replies if f.record and f.record.get("kind", "final") != "delta"]
    if finals:
        marks.append(("reply", finals[-1].ts_ms * 1000, finals[-1].where))
    marks.sort(key=lambda m: m[1])
    waterfall, prev = [], zero_us
    for label, us, where in marks:
        waterfall.append({"step": label, "at_ms": round((us - zero_us) / 1000, 1),
                          "hop_ms": round((us - prev) / 1000, 1), "event": where})
        prev = us
    request = next((f.record for f in journey.by_layer.get("gateway", []) if f.record), None)
    envelope = request["envelope"] if request else {}
    runs: dict[str, dict[str, Any]] = {}
    for c in chunks:
        run = runs.setdefault(c["run_id"], {"run_id": c["run_id"], "worker_id": c["worker_id"],
                                            "chunks": 0, "first_seq": c["seq"]})
        run["chunks"] += 1
    progress = progress_of(chunks)
    final = finals[-1].record if finals else None
    errors = [{"where": f.where, "error": f.error} for f in journey.events() if f.error]
    errors += [{"where": f.where, **f.record["error"]} for f in journey.chunks + journey.replies
               if f.record and f.record.get("error")]
    out: dict[str, Any] = {
        "request_id": journey.request_id,
        "found": bool(request),
        "entered": iso(zero_us // 1000, "milliseconds"),
        "tenant": envelope.get("tenant"),
        "job_id": envelope.get("job_id") or None,
        "model": (request or {}).get("generation", {}).get("model"),
        "kind": (request or {}).get("generation", {}).get("kind"),
        "layers": {layer: [f.where for f in journey.by_layer.get(layer) or []]
                   for layer in LAYERS},
        "waterfall": waterfall,
        "pool": next((f.record["route"]["pool"] for f in journey.by_layer.get("route", [])
                      if f.record), None),
        # an alias routed by meaning: route's decision and every route's score
        "meaning": next((f.record["route"].get("meaning") for f in
                         journey.by_layer.get("route", []) if f.record), None),
        "worker_id": chunks[-1]["worker_id"] if chunks else None,
        "attempt": max((f.record["envelope"]["attempt"] for f in journey.events()
                        if isinstance(f.record, dict) and "envelope" in f.record), default=0),
        "task_deliveries": len(journey.by_layer.get("schedule") or []),
        "runs": list(runs.values()),
        "chunks": len(chunks),
        "completion_tokens": progress.tokens,
        "finish_reason": (final or {}).get("finish_reason"),
        "usage": (final or {}).get("usage"),
        "replies": len(journey.replies),
        "cancels": [{"where": f.where, "reason": f.record["reason"]}
                    for f in journey.cancels if f.record],
        "dlq": [{"where": f.where, "layer": f.record["layer"],
                 "source": f"{f.record['topic']}[{f.record['partition']}]@{f.record['offset']}",
                 "error": last_line(f.record["error"])} for f in journey.letters if f.record],
        "errors": errors,
        "policy": _policy(request, chunks, final, errors),
        "read": journey.read,
    }
    if show_content and request:
        gen = request["generation"]
        out["prompt"] = gen["prompt"] if gen["kind"] == "completion" else gen["messages"]
        out["text"] = progress.text
    return plain(out)  # type: ignore[no-any-return]


_PLACEHOLDER = re.compile(r"<(?:EMAIL|PHONE|CARD|IBAN|IP)_\d+>")


def _policy(request: dict[str, Any] | None, chunks: list[dict[str, Any]],
            final: dict[str, Any] | None, errors: list[dict[str, Any]]) -> list[str]:
    """What the content policy did to the request (conveyor/policy), read from
    its events: blocked, its answer filtered, answered from the prompt cache,
    personal data redacted."""
    out = [f"input blocked: {e.get('message', '')}" for e in errors
           if e.get("code") == "content_policy_violation"]
    if (final or {}).get("finish_reason") == "content_filter":
        out.append("answer cut by the content filter")
    if chunks and chunks[0]["worker_id"] == CACHE_WORKER:
        out.append("answered from the prompt cache")
    gen = (request or {}).get("generation") or {}
    texts = [gen.get("prompt") or ""] + [m["content"] for m in gen.get("messages") or []]
    redacted = {m for text in texts for m in _PLACEHOLDER.findall(text)}
    if redacted:
        out.append(f"personal data redacted: {len(redacted)} placeholders")
    return out

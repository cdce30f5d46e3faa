"""``conveyor inspect REQUEST_ID``: one request's journey (:mod:`workers.journey`)
printed for a person or as JSON; content only with ``--show-content``. Usage:
docs/operating/log-tools.md."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from cli.text import add_report_flags, fail, not_found, print_report
from conveyor.settings import Settings
from topics.envelope import iso
from topics.lookup import parse_since
from workers.journey import find_journey, report

__all__ = ["render", "register"]

_BAR = 30

def render(rep: dict[str, Any]) -> str:
    """The report for a person: a header, the waterfall, then the rest."""
    lines = [f"request {rep['request_id']}  tenant {rep['tenant']}  model {rep['model']}  "
             f"entered {rep['entered']}" + (f"  job {rep['job_id']}" if rep["job_id"] else "")]
    steps = rep["waterfall"]
    total = max((s["at_ms"] for s in steps), default=0.0) or 1.0
    for s in steps:
        begin = int(_BAR * (s["at_ms"] - s["hop_ms"]) / total)
        width = max(1, int(_BAR * s["hop_ms"] / total)) if s["hop_ms"] > 0 else 1
        bar = (" " * begin + "#" * width)[:_BAR + 1]
        lines.append(f"  {s['step']:<12} {s['at_ms']:>9.1f} ms  +{s['hop_ms']:>8.1f}  "
                     f"|{bar:<{_BAR + 1}}|  {s['event']}")
    missing = [layer for layer, where in rep["layers"].items() if not where]
    if missing:
        lines.append(f"  no event found for: {', '.join(missing)}")
    lines.append(f"worker {rep['worker_id']} (pool {rep['pool']})  attempt {rep['attempt']}  "
                 f"task deliveries {rep['task_deliveries']}  runs {len(rep['runs'])}")
    meaning = rep.get("meaning")
    if meaning:
        scores = ", ".join(f"{s['route']} ({s['model']}) {s['score']:.4f}"
                           for s in meaning["scores"])
        lines.append(f"routed by meaning ({meaning['method']}, floor {meaning['floor']}): "
                     f"{meaning['alias']} -> {meaning['model']} "
                     f"({'route ' + meaning['route'] if meaning['route'] else 'the default'})"
                     f"  scores: {scores}")
    for run in rep["runs"]:
        lines.append(f"  run {run['run_id']} on {run['worker_id']}: {run['chunks']} chunks "
                     f"from seq {run['first_seq']}")
    lines.append(f"chunks {rep['chunks']}  completion tokens {rep['completion_tokens']}  "
                 f"finish {rep['finish_reason']}  usage {json.dumps(rep['usage'])}")
    for c in rep["cancels"]:
        lines.append(f"cancel at {c['where']}: {c['reason']}")
    for d in rep["dlq"]:
        lines.append(f"DLQ {d['where']} ({d['layer']}, from {d['source']}): {d['error']}")
    for e in rep["errors"]:
        lines.append(f"error at {e['where']}: " + ", ".join(
            f"{k}={v}" for k, v in e.items() if k != "where" and v is not None))
    for what in rep.get("policy") or ():
        lines.append(f"policy: {what}")
    if "prompt" in rep:
        lines.append("prompt: " + json.dumps(rep["prompt"], ensure_ascii=False))
        lines.append("text: " + rep["text"])
    read = sum(r["records"] for r in rep["read"])
    lines.append(f"read {read} records from {len(rep['read'])} partitions")
    return "\n".join(lines)


def cmd_inspect(settings: Settings, args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since)
    except ValueError as exc:
        return fail(f"conveyor inspect: {exc}")
    journey = asyncio.run(find_journey(settings, args.request_id, since))
    if journey is None:
        return fail(not_found("inspect", settings, args.request_id, iso(since, "milliseconds")), 1)
    return print_report(report(journey, args.show_content), args.json, render)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "inspect", help="a request's journey through the layers, read from the topics",
        description="Finds the request in its id's partition of the requests topic, read "
                    "from --since on (offsets_for_times); every other topic is read only "
                    "in the request's own partition and time window. No topic is scanned.")
    add_report_flags(p, "also print the prompt and the answer's text")
    p.set_defaults(func=cmd_inspect)

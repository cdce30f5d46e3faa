"""``conveyor accounting`` and ``conveyor usage``: run the usage ledger, read it
(without ``--since``: the last hour by minute, the last 30 days by day)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from cli.text import fail, table, utc
from conveyor.errors import RequestError
from conveyor.redis_clients import redis_client
from conveyor.settings import Settings
from topics.envelope import now_ms
from topics.lookup import parse_since

__all__ = ["register", "cmd_accounting", "cmd_usage"]

_DEFAULT_SPAN_MS = {"minute": 3_600_000, "day": 30 * 86_400_000}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``accounting`` and ``usage`` to the ``conveyor`` command line."""
    accounting = sub.add_parser("accounting",
                                help="the usage accounting app (reads conveyor.usage)")
    accounting.set_defaults(func=cmd_accounting)

    usage = sub.add_parser("usage", help="a tenant's usage from the ledger, by minute or day")
    usage.add_argument("--tenant", required=True)
    which = usage.add_mutually_exclusive_group()
    which.add_argument("--key", dest="key_id", default=None, help="one API key of the tenant")
    which.add_argument("--model", default=None, help="one model the tenant used")
    usage.add_argument("--since", default=None,
                       help="2026-11-01, 2026-11-01T12:30Z, 90m, 24h, 7d (default: 1h by "
                            "minute, 30d by day)")
    usage.add_argument("--until", default="now", help="as --since (default: now)")
    usage.add_argument("--by", choices=["minute", "day"], default="day")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage.set_defaults(func=cmd_usage)


def cmd_accounting(settings: Settings, args: argparse.Namespace) -> int:
    from conveyor.metrics import LayerMetrics, process_metrics
    from workers.usage.run import run_accounting

    nice = settings.process.accounting_nice
    if nice:  # the cold path yields the cores to the request path
        os.nice(nice)
    metrics = process_metrics(settings.telemetry, "accounting")
    from conveyor import heap

    run_accounting(settings, LayerMetrics(metrics.meter).layer("accounting"),
                   on_started=lambda: heap.settle(settings.process.gc_threshold, "accounting"))
    return 0


def cmd_usage(settings: Settings, args: argparse.Namespace) -> int:
    now = now_ms()
    try:
        until = parse_since(args.until, now)
        since = (parse_since(args.since, now) if args.since is not None
                 else until - _DEFAULT_SPAN_MS[args.by])
    except ValueError as exc:
        return fail(f"conveyor usage: {exc}")
    try:
        rows, ratings = asyncio.run(_report(settings, args, since, until))
    except RequestError as exc:
        return fail(f"conveyor usage: {exc.message}")
    if args.json:
        print(json.dumps({**_as_json(args, since, until, rows),
                          "ratings": [d.as_dict() for d in ratings]}, indent=2))
    else:
        print(_as_table(args.by, rows))
        if ratings:
            print("\n" + _ratings_table(ratings))
    return 0


async def _report(settings: Settings, args: argparse.Namespace, since: int,
                  until: int) -> tuple[list[Any], list[Any]]:
    """The usage rows, and the ratings by day (none for one key: ratings are
    kept per model and deployment)."""
    from workers.usage.ledger import UsageLedger

    redis = redis_client(settings.redis, "cli")
    try:
        ledger = UsageLedger(settings, redis)
        rows = await ledger.report(args.tenant, since_ms=since, until_ms=until, by=args.by,
                                   key_id=args.key_id, model=args.model)
        ratings = [] if args.key_id is not None else await ledger.ratings(
            args.tenant, since_ms=since, until_ms=until, model=args.model)
        return rows, ratings
    finally:
        await redis.aclose()


def _ratings_table(days: list[Any]) -> str:
    """Each day's ratings: in all, per model asked for, per deployment that answered."""
    lines = [("ratings (UTC day)", "of", "count", "mean")]
    for d in days:
        lines.append((utc(d.bucket_start_ms, "%Y-%m-%d"), "all", str(d.count), f"{d.mean:+.2f}"))
        for kind, counts in (("model", d.by_model), ("deployment", d.by_deployment)):
            for name, c in sorted(counts.items()):
                lines.append(("", f"{kind} {name or '(unfinished)'}", str(c["count"]),
                              f"{c['mean']:+.2f}"))
    return table(lines, left=2)


_FIELDS = ("requests", "errors", "prompt_tokens", "completion_tokens", "total_tokens")


def _totals(rows: list[Any]) -> dict[str, int]:
    return {f: sum(getattr(r, f) for r in rows) for f in _FIELDS}


def _as_json(args: argparse.Namespace, since: int, until: int,
             rows: list[Any]) -> dict[str, Any]:
    return {"tenant": args.tenant, "key_id": args.key_id, "model": args.model, "by": args.by,
            "since_ms": since, "until_ms": until, "rows": [r.as_dict() for r in rows],
            "total": _totals(rows)}


def _as_table(by: str, rows: list[Any]) -> str:
    fmt = "%Y-%m-%d %H:%M" if by == "minute" else "%Y-%m-%d"
    header = ("bucket (UTC)", "requests", "errors", "prompt", "completion", "total")
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        lines.append((utc(r.bucket_start_ms, fmt), *(str(getattr(r, f)) for f in _FIELDS)))
    lines.append(("total", *(str(v) for v in _totals(rows).values())))
    return table(lines, left=1)

"""``conveyor workers``: every infer worker as its last heartbeat tells
(:mod:`workers.fleet`), once or every ``--watch`` seconds (the columns:
docs/operating/processes.md). The topic is compacted (key = worker id), so a
worker that stopped for good stays listed with its last state; its age says
how long ago that was."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from cli.text import READ_WITHIN_S, table, unread
from conveyor.settings import Settings
from topics.catalog import BREAKERS, WORKERS
from workers.fleet import Fleet

__all__ = ["cmd_workers", "register", "render"]


def _kv_text(kv: dict[str, Any] | None) -> str:
    if kv is None:
        return "-"
    cached = "" if kv["cached_blocks"] is None else f" cached {kv['cached_blocks']}"
    hits = "" if kv["prefix_hit_rate"] is None else f" hits {kv['prefix_hit_rate']:.0%}"
    return (f"{kv['usage']:.0%} used, {kv['free_blocks']}/{kv['total_blocks']} free"
            f"{cached}{hits} ({kv['block_tokens']} tok/block)")


def _host_cache_text(held: dict[str, Any] | None) -> str:
    """The llama.cpp engines' caches in host memory (``--host-cache-mib``)."""
    if held is None:
        return "-"
    return (f"{held['entries']} seq {held['held_bytes'] / (1 << 20):.0f} MiB, "
            f"{held['restored']}/{held['saved']} restored")


def _gpu_text(row: dict[str, Any]) -> str:
    if row["gpu_utilization"] is None:
        return "-"
    free = row["gpu_memory_free"]
    return f"{row['gpu_utilization']:.0f}%" + (f" {free / (1 << 30):.1f} GiB free"
                                               if free is not None else "")


def _speed_text(row: dict[str, Any]) -> str:
    """Measured prefill rate and time per output token (``-`` until measured)."""
    prefill = f"{row['prefill_tps']:.0f} tok/s" if row["prefill_tps"] is not None else "-"
    tpot = f"{row['tpot_ms']:.1f} ms/tok" if row["tpot_ms"] is not None else "-"
    return f"{prefill} {tpot}"


def _models_text(row: dict[str, Any]) -> str:
    """The models it serves, those not loaded now in parentheses."""
    loaded = set(row["loaded"])
    return ",".join(m if m in loaded else f"({m})" for m in row["models"]) or "-"


def _breaker_text(breaker: dict[str, Any]) -> str:
    if breaker["state"] == "open":
        return f"open {breaker['open_for_s']:.0f}s"
    return str(breaker["state"])


def render(rows: list[dict[str, Any]]) -> str:
    """The table ``conveyor workers`` prints."""
    if not rows:
        return "no worker has sent a heartbeat"
    header = ("WORKER", "POOL", "ENGINE", "MODELS", "STATE", "LIVE", "RUN/CAP", "QUEUED",
              "PARTS", "KV", "HOST CACHE", "SPEED", "GPU", "BREAKER", "HOST", "AGE")
    lines = [header] + [(
        r["worker_id"], r["pool"], r["engine"], _models_text(r), r["state"],
        "yes" if r["live"] else "no",
        f"{r['running']}/{r['capacity']}", str(r["queued"]), str(len(r["partitions"])),
        _kv_text(r["kv"]), _host_cache_text(r["host_cache"]), _speed_text(r), _gpu_text(r),
        _breaker_text(r["breaker"]), r["host"],
        f"{r['heartbeat_age_s']:.0f}s")
        for r in rows]
    return table(lines)


async def _show(settings: Settings, args: argparse.Namespace) -> None:
    """Print the table once the topics are read, then (``--watch``) again and again."""
    fleet = Fleet(settings)
    following = asyncio.create_task(fleet.follow())
    try:
        await fleet.read(READ_WITHIN_S)
        while True:
            rows = fleet.rows(args.pool)
            if args.watch is None:
                print(json.dumps(rows, indent=2) if args.json else render(rows))
                return
            print(json.dumps(rows) if args.json else "\x1b[2J\x1b[H" + render(rows),
                  flush=True)
            await asyncio.sleep(args.watch)
    finally:
        following.cancel()


def cmd_workers(settings: Settings, args: argparse.Namespace) -> int:
    try:
        asyncio.run(_show(settings, args))
    except KeyboardInterrupt:
        pass
    except TimeoutError:
        return unread("workers", f"{WORKERS.at(settings.kafka)} and "
                                 f"{BREAKERS.at(settings.kafka)} were")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("workers", help="every infer worker: load, KV cache, GPU, breaker, "
                                       "last heartbeat",
                       description="Every infer worker as its last heartbeat on the workers "
                                   "topic tells.")
    p.add_argument("--pool", default=None, help="only the workers of this pool")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="print again every SECONDS, until Ctrl-C")
    p.set_defaults(func=cmd_workers)

"""``conveyor workers``: every infer worker as its last heartbeat tells, once or
every ``--watch`` seconds (the columns: docs/operating/processes.md). The
topic is compacted (key = worker id), so a worker that stopped for good stays
listed with its last state; its age says how long ago that was."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from cli.text import READ_WITHIN_S, table, unread
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import BreakerState, WorkerHeartbeat
from topics.catalog import BREAKERS, WORKERS
from topics.envelope import now_ms
from topics.follow import apply_all, follow
from workers.schedule.breakers import describe as describe_breaker

__all__ = ["cmd_workers", "describe", "register", "render"]


def describe(beat: WorkerHeartbeat, settings: Settings, now: int,
             breaker: BreakerState | None = None) -> dict[str, Any]:
    """One worker as ``--json`` prints it."""
    age_s = max(0.0, (now - beat["ts_ms"]) / 1000)
    kv = beat.get("kv")
    kv_out: dict[str, Any] | None = None
    if kv is not None:
        queries = kv["prefix_queries"]
        kv_out = {**kv, "prefix_hit_rate": kv["prefix_hits"] / queries if queries else None}
    return {
        "worker_id": beat["worker_id"], "pool": beat["pool"], "engine": beat["engine"],
        "models": beat["models"], "loaded": beat.get("loaded") or beat["models"],
        "state": beat["state"],
        "live": beat["state"] == "ready" and age_s <= settings.schedule.worker_ttl_s,
        "partitions": beat["partitions"], "capacity": beat["capacity"],
        "running": beat["running"], "queued": beat["queued"], "host": beat["host"],
        "gpu_utilization": beat["gpu_utilization"], "gpu_memory_free": beat["gpu_memory_free"],
        "kv": kv_out, "host_cache": beat.get("host_cache"),
        "heartbeat_age_s": round(age_s, 1),
        "prefill_tps": _rounded(beat.get("prefill_tps")),
        "tpot_ms": _rounded(beat.get("tpot_ms")),
        "breaker": describe_breaker(breaker, now),
    }


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


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


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


def _rows(beats: dict[str, WorkerHeartbeat], breakers: dict[str, BreakerState],
          settings: Settings, pool: str | None) -> list[dict[str, Any]]:
    now = now_ms()
    return [describe(b, settings, now, breakers.get(wid)) for wid, b in sorted(beats.items())
            if pool is None or b["pool"] == pool]


async def _show(settings: Settings, args: argparse.Namespace) -> None:
    """Print the table once the topics are read, then (``--watch``) again and again."""
    beats: dict[str, WorkerHeartbeat] = {}
    breakers: dict[str, BreakerState] = {}
    beating, breaking = follow(settings, WORKERS), follow(settings, BREAKERS)
    reading = [asyncio.create_task(apply_all(beating, default_codec(), lambda beat: beats.
                                             __setitem__(beat["worker_id"], beat))),
               asyncio.create_task(apply_all(breaking, default_codec(), lambda state: breakers.
                                             __setitem__(state["worker_id"], state)))]
    try:
        await asyncio.wait_for(asyncio.gather(beating.caught_up.wait(),
                                              breaking.caught_up.wait()), READ_WITHIN_S)
        while True:
            rows = _rows(beats, breakers, settings, args.pool)
            if args.watch is None:
                print(json.dumps(rows, indent=2) if args.json else render(rows))
                return
            print(json.dumps(rows) if args.json else "\x1b[2J\x1b[H" + render(rows),
                  flush=True)
            await asyncio.sleep(args.watch)
    finally:
        for task in reading:
            task.cancel()


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

"""``conveyor jobs``: the batches (and background responses) in the log, one a
line or one followed until it ends (``watch``). Read straight from
``conveyor.job-status``, so it works from any host that reaches Kafka."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from cli.text import fail
from conveyor.settings import Settings
from schemas.records import JobStatus
from topics.catalog import JOB_STATUS

__all__ = ["register", "progress_line", "read_statuses"]

_FINAL = ("completed", "failed", "cancelled", "expired", "incomplete")
_BAR = 24


def progress_line(job: dict[str, Any], tenant: str = "") -> str:
    """``batch_… [#########·······]  37/50 failed 1  in_progress  tenant``."""
    counts = job.get("request_counts") or {}
    total, done = counts.get("total", 0), counts.get("completed", 0) + counts.get("failed", 0)
    filled = int(_BAR * done / total) if total else (_BAR if job["status"] in _FINAL else 0)
    bar = "#" * filled + "." * (_BAR - filled)
    failed = f" failed {counts['failed']}" if counts.get("failed") else ""
    return (f"{job['id']}  [{bar}] {done:>5}/{total:<5}{failed}  {job['status']:<11} "
            f"{tenant}").rstrip()


async def read_statuses(settings: Settings) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every job's latest state: id -> (tenant, object)."""
    from schemas.codec import default_codec
    from topics.follow import follow, snapshot

    latest: dict[str, tuple[int, str, dict[str, Any]]] = {}

    def keep(status: JobStatus) -> None:
        held = latest.get(status["job_id"])
        if held is None or held[0] < status["version"]:
            latest[status["job_id"]] = (status["version"], status["tenant"],
                                        json.loads(status["object"]))

    await snapshot(follow(settings, JOB_STATUS, 0, "beginning"), default_codec(), keep, 30)
    return {job_id: (tenant, obj) for job_id, (_, tenant, obj) in latest.items()}


def cmd_jobs(settings: Settings, args: argparse.Namespace) -> int:
    if args.action == "watch":
        return _watch(settings, args.id, args.interval)
    statuses = asyncio.run(read_statuses(settings))
    jobs = [(t, o) for t, o in statuses.values() if o.get("object") == "batch"
            and (args.tenant is None or t == args.tenant)
            and (args.all or o["status"] not in _FINAL or
                 (o.get("created_at") or 0) > time.time() - 24 * 3600)]
    jobs.sort(key=lambda to: to[1].get("created_at") or 0, reverse=True)
    if not jobs:
        print("no batches")
    for tenant, job in jobs:
        print(progress_line(job, tenant))
    return 0


def _watch(settings: Settings, job_id: str | None, interval: float) -> int:
    if not job_id:
        return fail("conveyor jobs watch: which batch? (conveyor jobs watch BATCH_ID)")
    deadline = time.monotonic() + 48 * 3600
    last = ""
    while time.monotonic() < deadline:
        found = asyncio.run(read_statuses(settings)).get(job_id)
        if found is None:
            return fail(f"conveyor: no job {job_id}", 1)
        tenant, job = found
        line = progress_line(job, tenant)
        if line != last:
            print(line, flush=True)
            last = line
        if job["status"] in _FINAL:
            return 0 if job["status"] == "completed" else 1
        time.sleep(interval)
    return 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    jobs = sub.add_parser("jobs", help="batches in the log, with their progress")
    jobs.add_argument("action", nargs="?", choices=["list", "watch"], default="list")
    jobs.add_argument("id", nargs="?", default=None, help="watch: the batch id")
    jobs.add_argument("--tenant", default=None)
    jobs.add_argument("--all", action="store_true",
                      help="also batches that ended more than a day ago")
    jobs.add_argument("--interval", type=float, default=1.0, help="watch: seconds between looks")
    jobs.set_defaults(func=cmd_jobs)

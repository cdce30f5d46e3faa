"""``conveyor jobs``: batches read straight from conveyor.job-status."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import pytest

from cli import jobs as cli_jobs
from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import JobStatus
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer


def batch(job_id: str, status: str, done: int, total: int) -> dict[str, object]:
    return {"id": job_id, "object": "batch", "status": status, "created_at": int(time.time()),
            "request_counts": {"total": total, "completed": done, "failed": 0}}


async def publish(settings: Settings, states: list[tuple[str, int, dict[str, object]]]) -> None:
    await ensure_topics(settings, catalog(settings.kafka))
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for tenant, version, obj in states:
            status = JobStatus(job_id=str(obj["id"]), kind="batch", tenant=tenant,
                               version=version, ts_ms=0, object=json.dumps(obj))
            await producer.send_and_wait(settings.kafka.topic("job-status"),
                                         default_codec().encode("JobStatus", status),
                                         key=str(obj["id"]).encode())
    finally:
        await producer.stop()


def run(settings: Settings, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_jobs.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["jobs", *argv])
    result: int = args.func(settings, args)
    return result


def test_progress_line_draws_a_bar() -> None:
    line = cli_jobs.progress_line(batch("batch_a", "in_progress", 25, 50), "acme")
    assert line.startswith("batch_a  [############............]    25/50")
    assert line.endswith("in_progress acme")


def test_list_and_watch_read_the_newest_state(services: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    asyncio.run(publish(settings, [
        ("acme", 1, batch("batch_a", "in_progress", 1, 4)),
        ("acme", 3, batch("batch_a", "completed", 4, 4)),
        ("acme", 2, batch("batch_a", "in_progress", 3, 4)),  # older: ignored
        ("other", 1, batch("batch_b", "in_progress", 0, 9))]))
    assert run(settings, "--tenant", "acme") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "4/4" in out[0] and "completed" in out[0]
    assert run(settings, "watch", "batch_a", "--interval", "0.1") == 0
    assert "completed" in capsys.readouterr().out
    assert run(settings, "watch", "batch_nope") == 1

"""``conveyor workers`` against a running Conveyor: both workers of the shared
pipeline, live, with what their heartbeats say; and the table a person reads,
KV cache and GPU included, from heartbeats made here."""

from __future__ import annotations

import json

from cli.workers import describe, render
from conveyor.settings import Settings
from schemas.records import WorkerHeartbeat
from tests.support.pipeline import Pipeline
from topics.envelope import now_ms


def test_every_worker_of_the_pipeline_is_listed_live(pipeline: Pipeline) -> None:
    rows = json.loads(pipeline.cli("workers", "--json"))
    by_id = {r["worker_id"]: r for r in rows}
    assert {"w0", "w1"} <= set(by_id)
    for worker in ("w0", "w1"):
        row = by_id[worker]
        assert row["live"] and row["state"] == "ready" and row["pool"] == "cpu"
        assert row["engine"] == "scripted" and row["capacity"] == 2 and row["partitions"]
        assert row["kv"] is None and row["heartbeat_age_s"] < pipeline.settings.worker_ttl_s
    assert json.loads(pipeline.cli("workers", "--json", "--pool", "gpu")) == []
    table = pipeline.cli("workers").splitlines()
    assert table[0].split()[:3] == ["WORKER", "POOL", "ENGINE"]
    assert any(line.startswith("w0 ") for line in table)


def beat(worker: str, age_ms: int, **fields: object) -> WorkerHeartbeat:
    record: dict[str, object] = {
        "worker_id": worker, "pool": "cpu", "engine": "llamacpp-batch", "models": ["smollm2"],
        "state": "ready", "partitions": [0, 1], "capacity": 8, "running": 3, "queued": 1,
        "ts_ms": now_ms() - age_ms, "host": "h1", "gpu_utilization": None,
        "gpu_memory_free": None, "interactive_running": 0, "interactive_ms": 0, "kv": None,
        **fields}
    return record  # type: ignore[return-value]


def test_the_table_shows_kv_gpu_and_who_is_gone() -> None:
    settings = Settings(topic_prefix="workers-table")
    now = now_ms()
    kv = {"usage": 0.25, "total_blocks": 4096, "free_blocks": 3072, "cached_blocks": 500,
          "block_tokens": 1, "prefix_queries": 1000, "prefix_hits": 400}
    rows = [describe(beat("a", 500, kv=kv), settings, now),
            describe(beat("b", 60_000, gpu_utilization=87.0, gpu_memory_free=3 << 30),
                     settings, now)]
    assert rows[0]["live"] and not rows[1]["live"]  # b's last heartbeat is a minute old
    assert rows[0]["kv"]["prefix_hit_rate"] == 0.4
    text = render(rows)
    assert "25% used, 3072/4096 free cached 500 hits 40% (1 tok/block)" in text
    assert "87% 3.0 GiB free" in text
    assert render([]) == "no worker has sent a heartbeat"

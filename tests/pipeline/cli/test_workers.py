"""``conveyor workers`` against a running Conveyor: both workers of the shared
pipeline, live, with what their heartbeats say (the table's KV and GPU columns:
tests/unit/cli/test_workers_table.py)."""

from __future__ import annotations

import json

from tests.support.pipeline import Pipeline


def test_every_worker_of_the_pipeline_is_listed_live(pipeline: Pipeline) -> None:
    rows = json.loads(pipeline.cli("workers", "--json"))
    by_id = {r["worker_id"]: r for r in rows}
    assert {"w0", "w1"} <= set(by_id)
    for worker in ("w0", "w1"):
        row = by_id[worker]
        assert row["live"] and row["state"] == "ready" and row["pool"] == "cpu"
        assert row["engine"] == "scripted" and row["capacity"] == 2 and row["partitions"]
        assert row["kv"] is None
        assert row["heartbeat_age_s"] < pipeline.settings.schedule.worker_ttl_s
    assert json.loads(pipeline.cli("workers", "--json", "--pool", "gpu")) == []
    table = pipeline.cli("workers").splitlines()
    assert table[0].split()[:3] == ["WORKER", "POOL", "ENGINE"]
    assert any(line.startswith("w0 ") for line in table)

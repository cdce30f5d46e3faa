"""The table ``conveyor workers`` prints, KV cache and GPU included, from
heartbeats made here: who is live, what the KV cache holds, the GPU."""

from __future__ import annotations

from cli.workers import render
from conveyor.settings import load_settings
from schemas.records import WorkerHeartbeat
from topics.envelope import now_ms
from workers.fleet import describe


def beat(worker: str, age_ms: int, **fields: object) -> WorkerHeartbeat:
    record: dict[str, object] = {
        "worker_id": worker, "pool": "cpu", "engine": "llamacpp-batch", "models": ["smollm2"],
        "state": "ready", "partitions": [0, 1], "capacity": 8, "running": 3, "queued": 1,
        "ts_ms": now_ms() - age_ms, "host": "h1", "gpu_utilization": None,
        "gpu_memory_free": None, "interactive_running": 0, "interactive_ms": 0, "kv": None,
        **fields}
    return record  # type: ignore[return-value]


def test_the_table_shows_kv_gpu_and_who_is_gone() -> None:
    settings = load_settings(topic_prefix="workers-table")
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


def test_the_table_shows_each_worker_s_breaker() -> None:
    settings = load_settings(topic_prefix="workers-table")
    now = now_ms()
    opened = {"worker_id": "a", "pool": "cpu", "state": "open", "failures": 3,
              "until_ms": now + 12_000, "reason": "upstream refused", "ts_ms": now}
    rows = [describe(beat("a", 500), settings, now, opened),  # type: ignore[arg-type]
            describe(beat("b", 500), settings, now)]
    assert rows[0]["breaker"] == {"state": "open", "failures": 3, "open_for_s": 12.0,
                                  "reason": "upstream refused"}
    assert rows[1]["breaker"]["state"] == "closed"
    lines = render(rows).splitlines()
    assert "BREAKER" in lines[0] and "open 12s" in lines[1] and "closed" in lines[2]


def test_the_table_shows_the_host_cache_of_a_llamacpp_worker() -> None:
    settings = load_settings(topic_prefix="workers-table")
    now = now_ms()
    held = {"held_bytes": 300 << 20, "entries": 12, "saved": 40, "restored": 31, "evicted": 2}
    rows = [describe(beat("a", 500, host_cache=held), settings, now),
            describe(beat("b", 500), settings, now)]
    assert rows[0]["host_cache"] == held and rows[1]["host_cache"] is None
    lines = render(rows).splitlines()
    assert "HOST CACHE" in lines[0]
    assert "12 seq 300 MiB, 31/40 restored" in lines[1]

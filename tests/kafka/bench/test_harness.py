"""A benchmark leaves nothing in Redis: its run's keys go when it exits."""

from __future__ import annotations

import uuid

import redis

from bench.harness import drop_redis_keys

URL = "redis://127.0.0.1:6379/0"


def test_a_run_s_keys_are_dropped_and_no_other(services: None) -> None:
    prefix, other = f"b{uuid.uuid4().hex[:10]}", f"b{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(URL)
    try:
        for i in range(1_500):  # more than one delete's batch
            client.set(f"{prefix}:requests:row:{i}", "x", ex=60)
        client.set(f"{other}:usage:t", "y", ex=60)
        drop_redis_keys(URL, prefix)
        assert list(client.scan_iter(match=f"{prefix}:*", count=1000)) == []
        assert client.get(f"{other}:usage:t") == b"y"
    finally:
        client.delete(f"{other}:usage:t")
        client.close()

"""The gateway through Redis and Kafka outages of the test's own: its background
tasks outlive them, ``/healthz`` says what is wrong while it lasts and 200
again after, and a client hears "the pipeline is unavailable" at once rather
than waiting for a misleading ``no_worker_available``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.support.pipeline import Pipeline
from tests.support.services import OwnKafka, OwnRedis

ASK = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def health(p: Pipeline) -> tuple[int, dict[str, Any]]:
    try:
        r = httpx.get(f"{p.base_url}/healthz", timeout=5)
    except httpx.HTTPError as exc:
        return 0, {"error": repr(exc)}
    return r.status_code, r.json()


def wait_health(p: Pipeline, status: int, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        code, body = health(p)
        if code == status:
            return body
        assert time.monotonic() < deadline, f"/healthz stayed {code}: {body}"
        time.sleep(0.25)


def answered(p: Pipeline) -> httpx.Response:
    return httpx.post(f"{p.base_url}/v1/chat/completions", json=ASK, timeout=120)


def lease_holders(p: Pipeline, url: str) -> dict[str, str]:
    client = redis.Redis.from_url(url)
    try:
        return {k.decode(): (client.get(k) or b"").decode()
                for k in client.scan_iter(f"{p.prefix}:reply-lease:*", count=1000)}
    finally:
        client.close()


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline], module_redis: OwnRedis) -> Iterator[Pipeline]:
    """One worker on the module's own Redis, for the tests that stop or flush
    it; made whole again after each."""
    shared = module_pipelines(workers=1, CONVEYOR_REDIS_URL=module_redis.url,
                              CONVEYOR_REPLY_LEASE_TTL_S="3")
    try:
        yield shared
    finally:
        shared.heal(redis=module_redis)


def test_the_gateway_recovers_from_a_redis_outage(p: Pipeline, module_redis: OwnRedis) -> None:
    module_redis.stop()
    down = wait_health(p, 503, within=30)
    assert down["tasks"]["reply-lease"]["state"] == "degraded", down
    time.sleep(3)
    module_redis.start()
    wait_health(p, 200, within=60)
    r = answered(p)
    assert r.status_code == 200, r.text
    assert health(p)[0] == 200  # and the lease task is still alive


def test_the_gateway_takes_its_lease_again_after_a_flush(p: Pipeline,
                                                         module_redis: OwnRedis) -> None:
    [(key, holder)] = lease_holders(p, module_redis.url).items()
    module_redis.flush()
    deadline = time.monotonic() + 30
    while lease_holders(p, module_redis.url).get(key) != holder:
        assert time.monotonic() < deadline, "the lease was not taken again"
        time.sleep(0.25)
    time.sleep(3)  # a lease task that died would show by now
    assert wait_health(p, 200, within=10)["tasks"]["reply-lease"]["state"] == "ok"
    r = answered(p)
    assert r.status_code == 200, r.text


def test_kafka_down_is_a_quick_503_pipeline_unavailable(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka) -> None:
    p = pipeline_factory(workers=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap)
    gateway_log = p.logs / f"{p.prefix}-gateway.log"
    own_kafka.stop()
    lines_before = len(gateway_log.read_text(errors="replace").splitlines())
    started = time.monotonic()
    for _ in range(3):
        t0 = time.monotonic()
        r = answered(p)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "pipeline_unavailable", err
        assert "unavailable" in err["message"]
        assert took < 20, f"a 503 took {took:.1f} s"  # aiokafka alone would wait 30 s
    body = wait_health(p, 503, within=30)
    assert body["tasks"]["replies"]["state"] == "degraded", body
    time.sleep(max(0.0, 10 - (time.monotonic() - started)))
    logged = len(gateway_log.read_text(errors="replace").splitlines()) - lines_before
    assert logged < 100, f"{logged} log lines in about 10 s of outage"
    own_kafka.start()
    wait_health(p, 200, within=90)

"""Resumable streams when the services fail under them: the answer is read
back from the log, so neither a flushed nor a stopped Redis loses it, and a
stopped Kafka makes a resume a prompt 503 rather than a hang, then the whole
answer once the broker is back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.faults.test_resume import (
    COUNTING,
    assert_joined,
    dropped_after_three,
    resumed,
    stream_id,
    whole,
)
from tests.support.pipeline import Pipeline
from tests.support.services import OwnKafka, OwnRedis

ROUTE = "/v1/completions"
BODY = {**COUNTING, "max_tokens": 120}


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline], module_redis: OwnRedis) -> Iterator[Pipeline]:
    """One worker on the module's own Redis, for the tests that stop or flush
    it; made whole again after each."""
    shared = module_pipelines(workers=1, CONVEYOR_REDIS_URL=module_redis.url)
    try:
        yield shared
    finally:
        shared.heal(redis=module_redis)


def test_a_flushed_redis_loses_no_resumable_stream(p: Pipeline, module_redis: OwnRedis) -> None:
    reference = whole(p.base_url, ROUTE, BODY)
    first = dropped_after_three(p.base_url, ROUTE, BODY, then=module_redis.flush)
    rest = resumed(p.base_url, ROUTE, stream_id(first), last=first[-1].id)
    assert_joined(first, rest, reference)


def test_a_stopped_redis_does_not_stop_a_resume(p: Pipeline, module_redis: OwnRedis) -> None:
    """The stream is in the log; only the watch that keeps a generation alive for
    its reader is in Redis, and the gateway that took the request is alive."""
    reference = whole(p.base_url, ROUTE, BODY)
    first = dropped_after_three(p.base_url, ROUTE, BODY)
    module_redis.stop()
    try:
        rest = resumed(p.base_url, ROUTE, stream_id(first), last=first[-1].id)
    finally:
        module_redis.start()
    assert_joined(first, rest, reference)


def test_a_resume_while_kafka_is_down_is_a_503_then_whole_once_it_is_back(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka) -> None:
    # a grace long enough for the broker's restart: the dropped client is still coming back
    p = pipeline_factory(workers=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                         CONVEYOR_RESUME_GRACE_S="120")
    reference = whole(p.base_url, ROUTE, BODY)
    first = dropped_after_three(p.base_url, ROUTE, BODY)
    sid = stream_id(first)
    own_kafka.stop()
    try:
        started = time.monotonic()
        r = httpx.get(f"{p.base_url}{ROUTE}/{sid}/stream", timeout=60,
                      headers={"Last-Event-ID": str(first[-1].id)})
        took = time.monotonic() - started
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] and r.json()["error"]["message"]
        assert took < 30, f"the refusal took {took:.1f} s"
    finally:
        own_kafka.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            rest = resumed(p.base_url, ROUTE, sid, last=first[-1].id)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "no resume after the broker came back"
            time.sleep(2)
    assert_joined(first, rest, reference)

"""Every process serves Prometheus text that moves with traffic: the gateway on
/metrics, a layers process on its metrics port."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.pipeline import Pipeline
from tests.support.services import free_port
from topics.clients import make_producer


def _total(text: str, name: str, **labels: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_gateway_metrics_parse_and_move_with_a_request(pipeline: Pipeline) -> None:
    url = f"{pipeline.base_url}/metrics"
    before = httpx.get(url, timeout=10).text
    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "smollm2", "max_tokens": 3,
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    after = httpx.get(url, timeout=10)
    assert after.status_code == 200
    assert after.headers["content-type"].startswith("text/plain")
    ok = {"http_response_status_code": "200", "gen_ai_request_model": "smollm2"}
    assert (_total(after.text, "conveyor_gateway_requests_total", **ok)
            == _total(before, "conveyor_gateway_requests_total", **ok) + 1)
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert _total(after.text, ttft, gen_ai_operation_name="chat") == \
        _total(before, ttft, gen_ai_operation_name="chat") + 1
    usage = "gen_ai_client_token_usage_count"
    assert _total(after.text, usage, gen_ai_token_type="output") == \
        _total(before, usage, gen_ai_token_type="output") + 1


def test_refusals_at_the_edge_are_counted_by_route_and_status(pipeline: Pipeline) -> None:
    url = f"{pipeline.base_url}/metrics"
    name = "http_server_request_duration_seconds_count"
    bad = {"http_route": "/v1/chat/completions", "http_response_status_code": "400"}
    before = _total(httpx.get(url, timeout=10).text, name, **bad)
    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", timeout=10,
                   json={"model": "smollm2", "messages": "not a list"})
    assert r.status_code == 400
    assert _total(httpx.get(url, timeout=10).text, name, **bad) == before + 1


def test_a_layers_process_serves_metrics_on_its_port(pipeline: Pipeline) -> None:
    """A preprocess of its own (own topic prefix, so the shared pipeline is left
    alone) takes an event it cannot decode: counted, dead-lettered, lag 0."""
    port = free_port()
    prefix = f"t{uuid.uuid4().hex[:10]}"
    proc = pipeline.spawn(f"metrics-{prefix}", "--metrics-port", str(port), "layer",
                          "preprocess", env={"CONVEYOR_TOPIC_PREFIX": prefix})
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, pipeline.tail(f"metrics-{prefix}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the metrics port never answered"
        time.sleep(0.3)
    settings = pipeline.settings.replace(topic_prefix=prefix)

    async def produce() -> None:
        producer = make_producer(settings.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(settings.kafka.topic("requests"), b"not avro", key=b"x")
        finally:
            await producer.stop()

    asyncio.run(produce())
    layer = {"conveyor_layer": "preprocess"}
    text = ""
    while time.monotonic() < deadline + 30:
        text = httpx.get(url, timeout=2).text
        # the dead letter is counted before it is produced, the event as handled
        # after that: a scrape may come between the two
        if _total(text, "conveyor_layer_dead_letters_total", **layer) >= 1 and \
                _total(text, "conveyor_layer_events_total", **layer) >= 1:
            break
        time.sleep(0.3)
    assert _total(text, "conveyor_layer_dead_letters_total", **layer) == 1
    assert _total(text, "conveyor_layer_events_total", **layer) == 1
    assert _total(text, "conveyor_layer_handle_duration_seconds_count", **layer) == 1
    lags = [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "conveyor_layer_consumer_lag"
            and s.labels["conveyor_layer"] == "preprocess"]
    assert lags and all(s.value == 0 for s in lags)  # the partition it read, caught up
    assert _total(text, "process_cpu_seconds_total") > 0
    proc.terminate()
    proc.wait(timeout=30)

"""The instruments of conveyor.metrics record, and what they expose parses as
Prometheus text under the OpenTelemetry exporter's names."""

from __future__ import annotations

import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conveyor.metrics import (
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    GatewayMetrics,
    LayerMetrics,
    Metrics,
    WorkerMetrics,
    process_metrics,
)
from conveyor.settings import TelemetrySettings


def _samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_a_finished_request_is_counted_and_timed_under_the_genai_names() -> None:
    metrics = Metrics("gateway")
    gateway = GatewayMetrics(metrics.meter)
    gateway.request_ended(status=200, model="smollm2", tenant="acme", operation="chat",
                          started=10.0, first_at=10.05, ended=10.95,
                          input_tokens=12, output_tokens=10)
    gateway.request_ended(status=429, model="smollm2", tenant="acme", operation="chat",
                          started=20.0, first_at=None, ended=20.002,
                          input_tokens=None, output_tokens=None)
    samples = _samples(metrics.exposition().decode())

    assert _value(samples, "conveyor_gateway_requests_total", http_response_status_code="200",
                  gen_ai_request_model="smollm2", conveyor_tenant="acme",
                  gen_ai_operation_name="chat") == 1
    assert _value(samples, "conveyor_gateway_requests_total",
                  http_response_status_code="429") == 1
    ttft = "gen_ai_server_time_to_first_token_seconds"
    assert _value(samples, f"{ttft}_count") == 1  # the failed request has no TTFT
    assert abs(_value(samples, f"{ttft}_sum") - 0.05) < 1e-9
    bounds = [float(s.labels["le"]) for s in samples
              if s.name == f"{ttft}_bucket" and s.labels["le"] != "+Inf"]
    assert bounds == TTFT_BUCKETS
    assert _value(samples, f"{ttft}_bucket", le="0.06") == 1
    assert _value(samples, f"{ttft}_bucket", le="0.04") == 0
    # nine tokens after the first in 0.9 s
    tpot = "gen_ai_server_time_per_output_token_seconds_sum"
    assert abs(_value(samples, tpot) - 0.1) < 1e-9
    duration = "gen_ai_server_request_duration_seconds_count"
    assert _value(samples, duration, error_type="429") == 1
    assert sum(s.value for s in samples if s.name == duration) == 2
    tokens = [float(s.labels["le"]) for s in samples
              if s.name == "gen_ai_client_token_usage_bucket" and s.labels["le"] != "+Inf"
              and s.labels["gen_ai_token_type"] == "input"]
    assert tokens == TOKEN_BUCKETS
    assert _value(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == 12
    assert _value(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == 10
    assert any(s.name == "process_resident_memory_bytes" for s in samples)
    metrics.shutdown()


def test_layers_count_events_dead_letters_and_report_lag_per_partition() -> None:
    metrics = Metrics("layers")
    layers = LayerMetrics(metrics.meter)
    route = layers.layer("route", lambda: [(0, 5), (3, 0)])
    postprocess = layers.layer("postprocess")
    for _ in range(3):
        route.handled(0.002)
    postprocess.handled(0.3)
    postprocess.dead_letter()
    samples = _samples(metrics.exposition().decode())

    assert _value(samples, "conveyor_layer_events_total", conveyor_layer="route") == 3
    assert _value(samples, "conveyor_layer_handle_duration_seconds_bucket",
                  conveyor_layer="route", le="0.0025") == 3
    assert _value(samples, "conveyor_layer_dead_letters_total",
                  conveyor_layer="postprocess") == 1
    lag = "conveyor_layer_consumer_lag"
    assert _value(samples, lag, conveyor_layer="route", messaging_destination_partition_id="0") == 5
    assert _value(samples, lag, conveyor_layer="route", messaging_destination_partition_id="3") == 0
    metrics.shutdown()


def test_a_worker_reports_capacity_running_and_queued_at_each_scrape() -> None:
    metrics = Metrics("infer-cpu")
    load = [4, 1, 0]
    WorkerMetrics(metrics.meter, "w0", "cpu", lambda: (load[0], load[1], load[2]))
    first = _samples(metrics.exposition().decode())
    load[1:] = [3, 7]
    second = _samples(metrics.exposition().decode())

    assert _value(first, "conveyor_worker_capacity", conveyor_worker="w0", conveyor_pool="cpu") == 4
    assert _value(first, "conveyor_worker_running") == 1
    assert _value(second, "conveyor_worker_running") == 3
    assert _value(second, "conveyor_worker_queued") == 7
    metrics.shutdown()


def test_a_workers_host_cache_is_read_at_each_scrape() -> None:
    """What the llama.cpp engines keep in host memory, and what they saved,
    restored and evicted; nothing while the engine keeps no host cache."""
    metrics = Metrics("infer-cpu")
    counts: dict[str, int] | None = None
    WorkerMetrics(metrics.meter, "w0", "cpu", lambda: (1, 0, 0), lambda: counts)
    assert "conveyor_worker_host_cache" not in metrics.exposition().decode()
    counts = {"saved": 5, "restored": 3, "evicted": 1, "held_bytes": 9_500_000, "entries": 4}
    samples = _samples(metrics.exposition().decode())
    assert _value(samples, "conveyor_worker_host_cache_size_bytes", conveyor_worker="w0") == 9.5e6
    assert _value(samples, "conveyor_worker_host_cache_entries") == 4
    assert _value(samples, "conveyor_worker_host_cache_saved_total") == 5
    assert _value(samples, "conveyor_worker_host_cache_restored_total") == 3
    assert _value(samples, "conveyor_worker_host_cache_evicted_total") == 1
    metrics.shutdown()


def test_a_workers_dead_letters_count_as_the_infer_layers() -> None:
    metrics = Metrics("infer-cpu")
    worker = WorkerMetrics(metrics.meter, "w0", "cpu", lambda: (1, 0, 0))
    worker.dead_letter()
    worker.dead_letter()
    samples = _samples(metrics.exposition().decode())
    assert _value(samples, "conveyor_layer_dead_letters_total", conveyor_layer="infer",
                  conveyor_worker="w0") == 2
    metrics.shutdown()


def test_a_process_serves_its_metrics_on_its_port_and_none_without_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = process_metrics(TelemetrySettings(metrics_port=port), "layers")
    try:
        LayerMetrics(metrics.meter).layer("route").handled(0.001)
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert r.status_code == 200
        assert _value(_samples(r.text), "conveyor_layer_events_total") == 1
    finally:
        metrics.shutdown()

    off = process_metrics(TelemetrySettings(metrics_port=0), "layers")
    assert not off.enabled
    LayerMetrics(off.meter).layer("route").handled(0.001)
    assert b"conveyor_layer" not in off.exposition()

"""The gateway's /metrics route, and the switch that turns metrics off."""

from __future__ import annotations

import socket

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from conveyor.metrics import Metrics, process_metrics
from conveyor.settings import load_settings
from gateway.metrics_route import install_metrics


def _app(**settings: object) -> tuple[FastAPI, Metrics]:
    app = FastAPI()

    @app.get("/v1/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    metrics, _ = install_metrics(app, load_settings(**settings))  # type: ignore[arg-type]
    return app, metrics


def test_every_answer_is_timed_by_route_and_status() -> None:
    with TestClient(_app()[0]) as client:
        assert client.get("/v1/ping").status_code == 200
        text = client.get("/metrics").text
    assert 'http_route="/v1/ping"' in text and 'http_response_status_code="200"' in text


def test_metrics_off_records_nothing_and_serves_no_route() -> None:
    app, metrics = _app(metrics_enabled=False)
    with TestClient(app) as client:
        assert client.get("/v1/ping").status_code == 200
        assert client.get("/metrics").status_code == 404
    assert not metrics.enabled
    assert b"http_server" not in metrics.exposition()


def test_metrics_off_leaves_a_process_port_unserved() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = process_metrics(load_settings(metrics_enabled=False, metrics_port=port).telemetry,
                              "layers")
    try:
        assert not metrics.enabled
        try:
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("a port was served with metrics off")
    finally:
        metrics.shutdown()

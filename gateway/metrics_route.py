"""``GET /metrics``: the gateway's Prometheus metrics (:mod:`conveyor.metrics`) on
the API's port, outside ``/v1`` and so outside authentication, like ``/healthz``."""

from __future__ import annotations

import time

from fastapi import FastAPI, Response
from opentelemetry.metrics import Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.metrics import CONTENT_TYPE, DURATION_BUCKETS, GatewayMetrics, Metrics
from conveyor.settings import Settings

__all__ = ["install_metrics"]


def install_metrics(app: FastAPI, settings: Settings) -> tuple[Metrics, GatewayMetrics]:
    """The gateway's meter, the instruments each request is recorded in, and the
    route; with ``metrics_enabled`` false, a meter that records nothing and no route."""
    if not settings.telemetry.metrics_enabled:
        return Metrics("gateway", enabled=False), GatewayMetrics.off()
    metrics = Metrics("gateway")

    @app.get("/metrics", include_in_schema=False)
    async def exposition() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    duration = metrics.meter.create_histogram(
        "http.server.request.duration", unit="s",
        description="Duration of HTTP server requests, every answer (refusals too).",
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
    app.add_middleware(HttpMetrics, duration=duration)
    return metrics, GatewayMetrics(metrics.meter)


class HttpMetrics:
    """Every HTTP answer by route template (never a raw path) and status, refusals
    at the edge included."""

    def __init__(self, app: ASGIApp, duration: Histogram) -> None:
        self.app = app
        self.duration = duration

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            route = scope.get("route")
            self.duration.record(time.monotonic() - started, {
                "http.request.method": scope.get("method", ""),
                "http.route": getattr(route, "path", "") or "unmatched",
                "http.response.status_code": status})

"""``GET /metrics``: the gateway's Prometheus metrics, on the API's own port.

The route is outside ``/v1`` and so outside authentication, like
``/healthz``: Prometheus scrapes it without a key. Bind the gateway to a
network the scraper shares, or keep /metrics off the public path at the proxy.
What is recorded, and under which names, is in :mod:`conveyor.metrics`.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response

from conveyor.metrics import CONTENT_TYPE, GatewayMetrics, Metrics
from conveyor.settings import Settings

__all__ = ["install_metrics", "metrics_router"]

metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    exposition: bytes = request.app.state.metrics.exposition()
    return Response(exposition, media_type=CONTENT_TYPE)


def install_metrics(app: FastAPI, settings: Settings) -> None:
    """The gateway's meter (``app.state.metrics``), the instruments ``Serving``
    records each request in (``app.state.gateway_metrics``), and the route."""
    app.state.metrics = Metrics("gateway")
    app.state.gateway_metrics = GatewayMetrics(app.state.metrics.meter)
    app.include_router(metrics_router)

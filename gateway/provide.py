"""How routes are handed the gateway's services: :func:`services_of` is where
every router's dependencies read the one services object the lifespan made
(:class:`gateway.services.Services`), each taking the part its routes use.
It sits below the routers, so that no router imports what builds the
services, and answers 503 while the gateway is still starting."""

from __future__ import annotations

from typing import Any

from starlette.requests import HTTPConnection

from conveyor.errors import PipelineUnavailable

__all__ = ["services_of"]


def services_of(connection: HTTPConnection) -> Any:
    """The application's :class:`~gateway.services.Services`; 503 before the
    lifespan has made them."""
    services = getattr(connection.app.state, "services", None)
    if services is None:
        raise PipelineUnavailable("The gateway is starting; try again shortly.")
    return services

"""How routes are handed the gateway's services: a router's dependency
(``Depends(service("chat"))``) reads one part of the services object the
lifespan made (:class:`gateway.services.Services`). It sits below the
routers, so that no router imports what builds the services."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import HTTPConnection

from conveyor.errors import PipelineUnavailable

__all__ = ["service", "services_of"]


def services_of(connection: HTTPConnection) -> Any:
    """The application's :class:`~gateway.services.Services`; 503 before the
    lifespan has made them."""
    services = getattr(connection.app.state, "services", None)
    if services is None:
        raise PipelineUnavailable("The gateway is starting; try again shortly.")
    return services


def service(name: str) -> Callable[[HTTPConnection], Any]:
    """A dependency handing a route the services' part ``name``."""
    def part(connection: HTTPConnection) -> Any:
        return getattr(services_of(connection), name)
    return part

"""Every route of the gateway and every dependency it declares runs on the
event loop: FastAPI runs a plain ``def`` in a worker thread, a thread hop (and
a wait for the GIL) on every request."""

from __future__ import annotations

import inspect
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIWebSocketRoute

from conveyor.registry import Registry
from conveyor.settings import load_settings
from gateway.app import build_app


def _sync_calls(dependant: Dependant) -> list[str]:
    found = []
    call = dependant.call
    if call is not None and not (inspect.iscoroutinefunction(call)
                                 or inspect.isasyncgenfunction(call)):
        found.append(getattr(call, "__qualname__", repr(call)))
    for sub in dependant.dependencies:
        found.extend(_sync_calls(sub))
    return found


def _routes(routes: list[Any]) -> list[APIRoute | APIWebSocketRoute]:
    """The app's API routes, those of included routers too."""
    found: list[APIRoute | APIWebSocketRoute] = []
    for route in routes:
        if isinstance(route, (APIRoute, APIWebSocketRoute)):
            found.append(route)
        included = getattr(route, "original_router", None)  # an included router
        if included is not None:
            found.extend(_routes(included.routes))
    return found


def test_no_route_or_dependency_runs_in_a_worker_thread() -> None:
    app = build_app(load_settings(), Registry.parse("", "test"))
    routes = _routes(app.routes)
    assert len(routes) > 30  # the whole API, the console included
    threaded = {f"{sorted(getattr(r, 'methods', None) or ['WS'])} {r.path}": calls
                for r in routes if (calls := _sync_calls(r.dependant))}
    assert threaded == {}

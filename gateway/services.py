"""The gateway's services: one frozen, typed object that the lifespan makes once
its collaborators are connected (gateway/app.py); a route takes the part it
uses by dependency (``Depends(service("chat"))``). Nothing here imports a
router or what builds the services."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from conveyor.errors import PipelineUnavailable
from conveyor.files.local import LocalFileStore
from conveyor.policy.rules import PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway.auth.authenticate import Authenticator
from gateway.chat.serving import ChatServing
from gateway.health import Health
from gateway.jobs.background import BackgroundResponses
from gateway.jobs.batches import Batches
from gateway.messages.serving import MessagesServing
from gateway.publisher import Publisher
from gateway.responses.serving import ResponsesServing
from gateway.stored import StoredAnswers
from gateway.submission import Submitter
from topics.groups import GroupReader
from topics.lookup import SharedLookup
from workers.fleet import Fleet
from workers.usage.ledger import UsageLedger
from workers.usage.requests import RequestIndex

__all__ = ["Services", "service", "services_of"]


@dataclass(frozen=True)
class Services:
    """What the gateway's routes are served by, made in the lifespan."""

    settings: Settings
    health: Health
    registry: Registry
    authenticator: Authenticator
    policies: PolicyBook
    publisher: Publisher
    submitter: Submitter
    stored: StoredAnswers
    chat: ChatServing
    responses: ResponsesServing
    messages: MessagesServing  # Anthropic's Messages API
    files: LocalFileStore
    batches: Batches
    background: BackgroundResponses
    usage: UsageLedger
    requests: RequestIndex  # every request as the accounting app indexed it (the console)
    fleet: Fleet  # every infer worker, as the console shows them
    lookup: SharedLookup  # the gateway's one keyed reader of the log
    groups: GroupReader  # the consumer groups, as the console's overview shows them


def services_of(connection: HTTPConnection) -> Services:
    """The application's services; 503 before the lifespan has made them."""
    services: Services | None = getattr(connection.app.state, "services", None)
    if services is None:
        raise PipelineUnavailable("The gateway is starting; try again shortly.")
    return services


def service(name: str) -> Callable[[HTTPConnection], Awaitable[Any]]:
    """A dependency handing a route the services' part ``name`` (a coroutine:
    FastAPI runs a plain function in a worker thread, a hop every request)."""
    async def part(connection: HTTPConnection) -> Any:
        return getattr(services_of(connection), name)
    return part

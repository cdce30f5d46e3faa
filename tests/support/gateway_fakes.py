"""What a gateway test stands in at the Kafka seam: the producer the
gateway's publisher sends cancels and requests with, and the reply router
(with the lease whose Redis it reads). The real Redis stays real (the
``redis`` fixture in tests/conftest.py). With them, the gateway's own parts
as the lifespan wires them (:func:`submitter`, :func:`chat_serving`,
:func:`responses_serving`), and :func:`offline_services` for an application
whose lifespan does not run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis.asyncio as aioredis

from conveyor.files.images import ImageStore
from conveyor.files.local import LocalFileStore
from conveyor.policy.rules import PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway.admission import Admitter
from gateway.auth.authenticate import Authenticator
from gateway.cancels import Cancels, ResumeWatch
from gateway.chat.serving import ChatServing
from gateway.health import Health
from gateway.images import ImageIntake
from gateway.jobs.background import BackgroundResponses
from gateway.jobs.batches import Batches
from gateway.jobs.board import JobBoard
from gateway.messages.serving import MessagesServing
from gateway.publisher import Publisher
from gateway.responses.serving import ResponsesServing
from gateway.services import Services
from gateway.stored import StoredAnswers
from gateway.submission import Submitter
from schemas.codec import default_codec
from topics.groups import GroupReader
from topics.lookup import SharedLookup
from workers.fleet import Fleet
from workers.usage.ledger import UsageLedger
from workers.usage.requests import RequestIndex

__all__ = ["HANG", "Lease", "RecordingProducer", "Router", "ScriptedProducer", "publisher",
           "cancels", "submitter", "chat_serving", "responses_serving", "offline_services"]

_MODELS = Path(__file__).resolve().parents[1] / "data" / "models.toml"

HANG: Literal["hang"] = "hang"


@dataclass
class RecordingProducer:
    """AIOKafkaProducer.send_and_wait at the seam: what the gateway sends lands here."""

    sent: list[tuple[str, bytes]] = field(default_factory=list)

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                            headers: Any = None) -> None:
        self.sent.append((topic, value))

    def cancelled(self) -> list[str]:
        """The request ids of the cancels sent, in order."""
        codec = default_codec()
        return [codec.decode(value, "Control")["request_id"] for _, value in self.sent]


@dataclass
class ScriptedProducer:
    """The producer's send_and_wait at the seam, failing as a script says: each
    send takes the script's next outcome (an exception to raise, or ``HANG``: a
    broker that holds the record and never answers); once the script is spent
    every send is taken. Raise what aiokafka raises, so that the translation of
    its errors is what is tested."""

    script: list[BaseException | Literal["hang"]] = field(default_factory=list)
    sent: list[tuple[str, bytes, bytes | None, Any]] = field(default_factory=list)
    attempts: int = 0
    started: bool = False
    stopped: bool = False

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                            headers: Any = None) -> None:
        self.attempts += 1
        outcome = self.script.pop(0) if self.script else None
        if outcome == HANG:
            await asyncio.sleep(3600)
        if isinstance(outcome, BaseException):
            raise outcome
        self.sent.append((topic, value, key, headers))

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


def publisher(settings: Settings, producer: Any) -> Publisher:
    """The gateway's publisher over a stand-in for its producer."""
    return Publisher(settings, producer, default_codec())


@dataclass
class Lease:
    redis: aioredis.Redis | None = None


@dataclass
class Router:
    lease: Lease = field(default_factory=Lease)
    closed: list[str] = field(default_factory=list)

    def close(self, request_id: str) -> None:
        self.closed.append(request_id)


def cancels(settings: Settings, producer: Any, redis: aioredis.Redis | None = None) -> Cancels:
    """The gateway's cancels over a stand-in producer, the watch in ``redis``."""
    return Cancels(settings, publisher(settings, producer),
                   ResumeWatch(settings, redis))  # type: ignore[arg-type]


def submitter(settings: Settings, producer: Any, router: Any = None,
              redis: aioredis.Redis | None = None) -> Submitter:
    """The gateway's submitter over a stand-in producer and reply router, every
    model of tests/data/models.toml admitted without limits."""
    out = publisher(settings, producer)
    return Submitter(settings, out, router or Router(),
                     Cancels(settings, out, ResumeWatch(settings, redis)),  # type: ignore[arg-type]
                     Admitter(Registry.load(_MODELS)), PolicyBook(), "g")


def _stored(settings: Settings, lookup: SharedLookup | None) -> StoredAnswers:
    return StoredAnswers(settings, lookup or SharedLookup(settings), default_codec())


def chat_serving(settings: Settings, producer: Any, redis: aioredis.Redis | None = None,
                 lookup: SharedLookup | None = None) -> ChatServing:
    """Chat completions' serving as the lifespan wires it, over the stand-ins."""
    made = submitter(settings, producer, redis=redis)
    registry = Registry.load(_MODELS)
    return ChatServing(settings, made, _stored(settings, lookup), registry,
                       image_intake(settings, registry))


def image_intake(settings: Settings, registry: Registry,
                 admitter: Admitter | None = None) -> ImageIntake:
    """The gateway's intake of images, into the files store of ``settings``
    (``admitter``: none limits the caller unless given)."""
    return ImageIntake(settings.images, ImageStore(LocalFileStore(settings.jobs)), registry,
                       admitter or Admitter(registry))


def responses_serving(settings: Settings, producer: Any, redis: aioredis.Redis | None = None,
                      lookup: SharedLookup | None = None,
                      background: BackgroundResponses | None = None) -> ResponsesServing:
    """The Responses API's serving as the lifespan wires it, over the stand-ins."""
    made = submitter(settings, producer, redis=redis)
    return ResponsesServing(settings, made, _stored(settings, lookup), background)


def offline_services(settings: Settings, registry: Registry | None = None) -> Services:
    """The services of an application whose lifespan does not run: the edge and
    what needs no broker are real (auth ``none``, the files store, the models),
    Kafka is a recording stand-in, and background responses are not enabled."""
    registry = registry or Registry.load(_MODELS)
    producer = RecordingProducer()
    made = submitter(settings, producer)
    stored = _stored(settings, None)
    files = LocalFileStore(settings.jobs)
    board = JobBoard(settings, default_codec())
    background = BackgroundResponses(settings, made.publisher, board)
    return Services(
        settings=settings, health=Health("g"), registry=registry,
        authenticator=Authenticator(settings), policies=made.policies,
        publisher=made.publisher, submitter=made, stored=stored,
        chat=ChatServing(settings, made, stored, registry, image_intake(settings, registry)),
        responses=ResponsesServing(settings, made, stored, None,
                                   image_intake(settings, registry)),
        messages=MessagesServing(settings, made, registry),
        files=files, batches=Batches(settings, made.publisher, board, files),
        background=background,
        usage=UsageLedger(settings, aioredis.from_url(settings.redis.url)),
        requests=RequestIndex(settings, aioredis.from_url(settings.redis.url)),
        fleet=Fleet(settings), lookup=stored.lookup, groups=GroupReader(settings))

"""What a gateway test stands in at the Kafka seam: the producer the
gateway's publisher sends cancels and requests with, and the reply router
(with the lease whose Redis it reads). The real Redis stays real (the
``redis`` fixture in tests/conftest.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis

from conveyor.settings import Settings
from gateway.publisher import Publisher
from schemas.codec import default_codec

__all__ = ["HANG", "Lease", "RecordingProducer", "Router", "ScriptedProducer", "publisher"]

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

"""What a gateway test stands in at the Kafka seam: the producer the
gateway sends cancels and requests with, and the reply router (with the
lease whose Redis it reads). The real Redis stays real (the ``redis``
fixture in tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from schemas.codec import default_codec

__all__ = ["Lease", "RecordingProducer", "Router"]


@dataclass
class RecordingProducer:
    """AIOKafkaProducer.send_and_wait at the seam: what the gateway sends lands here."""

    sent: list[tuple[str, bytes]] = field(default_factory=list)

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append((topic, value))

    def cancelled(self) -> list[str]:
        """The request ids of the cancels sent, in order."""
        codec = default_codec()
        return [codec.decode(value, "Control")["request_id"] for _, value in self.sent]


@dataclass
class Lease:
    redis: aioredis.Redis | None = None


@dataclass
class Router:
    lease: Lease = field(default_factory=Lease)
    closed: list[str] = field(default_factory=list)

    def close(self, request_id: str) -> None:
        self.closed.append(request_id)

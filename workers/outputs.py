"""What a layer's handler asks the runtime to produce, and the error replies
and dead letters every layer sends the same way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer

from conveyor.errors import RequestError
from conveyor.settings import Settings
from schemas.codec import Codec, EventType
from schemas.records import DeadLetter, Envelope, ErrorInfo, Reply
from topics.envelope import now_ms

__all__ = ["Output", "Sender", "error_info"]


@dataclass(frozen=True)
class Output:
    topic: str
    event_type: EventType
    record: Any
    key: str | None = None
    partition: int | None = None


def error_info(exc: RequestError) -> ErrorInfo:
    return ErrorInfo(
        status=exc.status, type=exc.type, code=exc.code, param=exc.param, message=exc.message
    )


def _headers(out: Output) -> list[tuple[str, bytes]] | None:
    """The W3C trace context as a Kafka header, for events that belong to a request."""
    envelope = out.record.get("envelope") if isinstance(out.record, dict) else None
    return [("traceparent", envelope["traceparent"].encode())] if envelope else None


@dataclass
class Sender:
    """Encodes and produces outputs; remembers the acknowledgements to await."""

    settings: Settings
    producer: AIOKafkaProducer
    codec: Codec
    pending: list[asyncio.Future[Any]] = field(default_factory=list)

    async def send(self, out: Output) -> None:
        self.pending.append(await self.send_nowait(out))

    async def send_nowait(self, out: Output) -> asyncio.Future[Any]:
        """Produce one output; the caller owns (and awaits) its acknowledgement."""
        value = self.codec.encode(out.event_type, out.record)
        key = out.key.encode() if out.key is not None else None
        fut: asyncio.Future[Any] = await self.producer.send(
            out.topic, value, key=key, partition=out.partition, headers=_headers(out))
        return fut

    async def deliver(self, out: Output) -> None:
        """Produce one output and wait for its acknowledgement alone."""
        await (await self.send_nowait(out))

    async def flush(self) -> None:
        """Wait until everything sent so far is acknowledged (raises on failure)."""
        pending, self.pending = self.pending, []
        if pending:
            await asyncio.gather(*pending)

    async def error_reply(self, envelope: Envelope, error: ErrorInfo, index: int = 0) -> None:
        """Fail one request: its gateway answers the client with the error."""
        if envelope["reply_partition"] < 0:
            return
        reply = Reply(
            envelope=envelope,
            index=index,
            kind="error",
            text="",
            chunk="",
            finish_reason=None,
            usage=None,
            error=error,
        )
        await self.send(
            Output(
                self.settings.topic("replies"),
                "Reply",
                reply,
                key=envelope["request_id"],
                partition=envelope["reply_partition"],
            )
        )

    async def dead_letter(
        self,
        layer: str,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        error: str,
    ) -> None:
        letter = DeadLetter(
            layer=layer,
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            error=error[:4000],
            ts_ms=now_ms(),
        )
        await self.send(
            Output(self.settings.topic("dlq"), "DeadLetter", letter,
                   key=key.decode(errors="replace") if key else None)
        )

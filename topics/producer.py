"""The one producer of a process, which outlives a broken idempotent session:
:class:`Producer` replaces its ``AIOKafkaProducer`` when the broker refuses its
producer id or sequence or its sender is dead, and sends each refused record
once more on the fresh one (it was not written, so nothing doubles). Records
may then land out of send order; readers order chunks by seq. Why:
docs/decisions/0012-aiokafka-not-librdkafka.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors

from conveyor.errors import TransientBrokerError

__all__ = ["Producer", "breaks_sequence"]

log = logging.getLogger(__name__)

# The broker refused the producer id or its sequence: nothing of that batch
# was written, and the producer cannot send to that partition again.
# (InvalidProducerEpoch reaches a send as ProducerFenced.)
_SEQUENCE_BROKEN = (
    kafka_errors.OutOfOrderSequenceNumber,
    kafka_errors.UnknownProducerId,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.ProducerFenced,
    kafka_errors.InvalidProducerIdMapping,
)
# tries of one record's send: a producer found dead, or retired under it
_ATTEMPTS = 3


def breaks_sequence(exc: BaseException) -> bool:
    """Whether ``exc`` says the idempotent producer's id or sequence is broken."""
    return isinstance(exc, _SEQUENCE_BROKEN)


def _sender_died(producer: AIOKafkaProducer) -> bool:
    """The producer's background sender has ended: every send fails from now on.
    (aiokafka has no public word for it; its private ``_sender`` is read with
    defaults, so another version reads as "alive".)"""
    task = getattr(getattr(producer, "_sender", None), "sender_task", None)
    return task is not None and task.done() and not task.cancelled()  # cancelled: stopped


@dataclass(frozen=True)
class _Record:
    topic: str
    value: bytes | None
    key: bytes | None
    partition: int | None
    timestamp_ms: int | None
    headers: list[tuple[str, bytes]] | None


class Producer:
    """``AIOKafkaProducer``'s send, send_and_wait, flush and partitions_for, on
    a producer that is replaced when its idempotent session breaks."""

    def __init__(self, make: Callable[[], AIOKafkaProducer], *,
                 start_timeout_s: float = 30.0) -> None:
        self._make = make
        self.start_timeout_s = start_timeout_s
        self._current = make()
        self._broken: AIOKafkaProducer | None = None  # the current one, once found broken
        self._cause: BaseException | None = None
        self._renewing = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._resends: set[asyncio.Task[None]] = set()
        self._stopped = False
        self.renewals = 0

    async def start(self) -> None:
        await self._current.start()

    async def stop(self) -> None:
        await self._settle_resends()
        self._stopped = True
        await self._current.stop()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def flush(self) -> None:
        """Wait until everything sent so far is acknowledged or failed."""
        await self._settle_resends()
        await self._current.flush()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    async def partitions_for(self, topic: str) -> set[int]:
        partitions: set[int] = await self._current.partitions_for(topic)
        return partitions

    async def send_and_wait(self, topic: str, value: bytes | None = None,
                            key: bytes | None = None, partition: int | None = None,
                            timestamp_ms: int | None = None,
                            headers: list[tuple[str, bytes]] | None = None) -> Any:
        fut = await self.send(topic, value, key, partition, timestamp_ms, headers)
        return await fut

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                   partition: int | None = None, timestamp_ms: int | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        """Queue one record; the future resolves with its RecordMetadata or error."""
        record = _Record(topic, value, key, partition, timestamp_ms, headers)
        outer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._submit(record, outer, resent=False)
        return outer

    # -- one record ----------------------------------------------------------

    async def _submit(self, record: _Record, outer: asyncio.Future[Any], resent: bool) -> None:
        producer, inner = await self._send_once(record)
        inner.add_done_callback(partial(self._settle, producer, record, outer, resent))

    async def _send_once(self, record: _Record) -> tuple[AIOKafkaProducer, asyncio.Future[Any]]:
        failure: Exception | None = None
        for _ in range(_ATTEMPTS):
            producer = await self._usable()
            try:
                fut = await producer.send(record.topic, record.value, record.key,
                                          record.partition, record.timestamp_ms, record.headers)
                return producer, fut
            except kafka_errors.ProducerClosed as exc:
                if producer is self._current:
                    raise  # this Producer was stopped
                failure = exc  # retired between _usable and send: its successor takes it
            except Exception as exc:
                if not (breaks_sequence(exc) or _sender_died(producer)):
                    raise
                self._found_broken(producer, exc)
                failure = exc
        assert failure is not None
        raise failure

    def _settle(self, producer: AIOKafkaProducer, record: _Record, outer: asyncio.Future[Any],
                resent: bool, inner: asyncio.Future[Any]) -> None:
        """Pass the acknowledgement on, or send a refused record once more."""
        error = None if inner.cancelled() else inner.exception()
        if error is not None and breaks_sequence(error):
            self._found_broken(producer, error)
            if not resent and not outer.done():
                task = asyncio.create_task(self._resend(record, outer))
                self._resends.add(task)
                task.add_done_callback(self._resends.discard)
                return
        if outer.done():
            return  # its caller stopped waiting
        if inner.cancelled():
            outer.cancel()
        elif error is not None:
            outer.set_exception(error)
        else:
            outer.set_result(inner.result())

    async def _resend(self, record: _Record, outer: asyncio.Future[Any]) -> None:
        try:
            await self._submit(record, outer, resent=True)
        except Exception as exc:
            if not outer.done():
                outer.set_exception(exc)

    async def _settle_resends(self) -> None:
        while self._resends:
            await asyncio.gather(*self._resends, return_exceptions=True)

    # -- renewal -------------------------------------------------------------

    def _found_broken(self, producer: AIOKafkaProducer, cause: BaseException) -> None:
        if producer is self._current and self._broken is None and not self._stopped:
            self._broken, self._cause = producer, cause

    async def _usable(self) -> AIOKafkaProducer:
        """The current producer, replaced first if it was found broken."""
        if self._broken is None:
            return self._current
        async with self._renewing:
            if self._broken is not None:
                await self._renew()
        return self._current

    async def _renew(self) -> None:
        fresh = self._make()
        try:
            await asyncio.wait_for(fresh.start(), self.start_timeout_s)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await fresh.stop()
            raise TransientBrokerError(
                f"the Kafka producer broke ({self._cause!r}) and a fresh one could not "
                f"start yet: {exc!r}") from exc
        old, self._current = self._current, fresh
        self._broken, cause, self._cause = None, self._cause, None
        self.renewals += 1
        log.warning("Kafka producer: the broker refused its producer id or sequence (%r); "
                    "continuing on a fresh producer (renewal %d), refused records are "
                    "sent again", cause, self.renewals)
        task = asyncio.create_task(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, old: AIOKafkaProducer) -> None:
        """Stop a replaced producer once it has delivered (or failed) what it holds."""
        try:
            await old.stop()
        except Exception as exc:  # its records' futures carry their own errors
            log.warning("Kafka producer: stopping a replaced producer failed: %r", exc)

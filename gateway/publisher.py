"""The gateway's one way to write to Kafka, the twin of the workers'
:class:`~workers.outputs.Sender`; aiokafka's errors become Conveyor's here.
Three policies (docs/architecture.md#delivery): ``publish`` on a request's path
(400, 413, or 503 when not taken within ``produce_timeout_s``), ``deliver``
must arrive (sent again until its bound), ``publish_soon`` fire and forget."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from conveyor.errors import (
    BrokerError,
    InvalidRequest,
    PermanentBrokerError,
    PipelineUnavailable,
    RequestTooLarge,
    SchemaError,
)
from conveyor.settings import Settings
from schemas.codec import Codec
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import Topic
from topics.clients import EventTooLarge, KafkaError, broker_error
from topics.envelope import now_ms
from topics.producer import Producer

__all__ = ["NotTakenInTime", "Publisher", "Headers"]

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]

# what a send to Kafka raises when the broker fails (ConnectionError and
# TimeoutError are OSErrors); anything else is a fault of Conveyor's and surfaces
_BROKER_FAILURES: tuple[type[Exception], ...] = (KafkaError, BrokerError, OSError)
# what drops a fire-and-forget event: those, and a record its schema cannot hold
_DROPPED: tuple[type[Exception], ...] = (SchemaError, *_BROKER_FAILURES)


class _PastBound(Exception):
    """A must-arrive send's bound passed before Kafka took it."""


class NotTakenInTime(PipelineUnavailable):
    """Kafka did not acknowledge an event within ``produce_timeout_s``. The
    event may still be written after the wait gave up: a request that may
    still arrive is followed by its cancel."""


def _sentence(what: str) -> str:
    return what[:1].upper() + what[1:]


class Publisher:
    """Encodes records for typed topics and produces them with one of three
    policies (see the module); tracks its background sends until :meth:`close`."""

    def __init__(self, settings: Settings, producer: Producer, codec: Codec) -> None:
        self.settings = settings
        self.producer = producer
        self.codec = codec
        self.problems = RateLimitedLog(log)
        self._pending: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        await self.producer.start()

    # -- on a request's path ----------------------------------------------------

    async def publish(self, topic: Topic, record: Any, key: str, *,
                      headers: Headers | None = None, what: str = "the event") -> None:
        """Produce ``record`` and wait at most ``produce_timeout_s`` for Kafka to
        take it; every failure is a :class:`~conveyor.errors.RequestError` for the
        client (``what`` names the record in its message)."""
        value = self.encode(topic, record, what)
        try:
            await asyncio.wait_for(
                self.producer.send_and_wait(topic.at(self.settings.kafka), value, key=key.encode(),
                                            headers=headers),
                self.settings.gateway.produce_timeout_s)
        except TimeoutError:
            raise NotTakenInTime(f"The pipeline is unavailable (Kafka did not take {what} in "
                                 "time); try again later.") from None
        except _BROKER_FAILURES as exc:
            error = broker_error(exc)
            if isinstance(error, EventTooLarge):
                raise RequestTooLarge(f"{_sentence(what)} is larger than the pipeline can "
                                      f"carry in one event: {exc}") from exc
            raise PipelineUnavailable(f"The pipeline is unavailable ({error}); "
                                      "try again later.") from exc

    def encode(self, topic: Topic, record: Any, what: str = "the event") -> bytes:
        """``record`` as ``topic``'s event; 400 for a value the schema cannot hold,
        413 over ``max_event_bytes`` (said at once, before a round trip)."""
        try:
            value = topic.encode(self.codec, record)
        except SchemaError as exc:
            raise InvalidRequest(f"{_sentence(what)} holds a value the pipeline cannot "
                                 f"carry: {exc}") from exc
        if len(value) > self.settings.kafka.max_event_bytes:
            raise RequestTooLarge(f"{_sentence(what)} is {len(value)} bytes as an event; at "
                                  f"most {self.settings.kafka.max_event_bytes} fit.")
        return value

    # -- in the background --------------------------------------------------------

    def deliver(self, topic: Topic, record: Any, key: str, *, until_ms: int | None = None,
                what: str = "an event") -> asyncio.Task[bool]:
        """Produce ``record`` in the background, again with backoff, until Kafka takes
        it or ``until_ms`` passes (default ``request_timeout_s`` from now); the task
        says whether it was delivered. A record that cannot be encoded raises here."""
        value = topic.encode(self.codec, record)
        bound_ms = until_ms if until_ms is not None else (
            now_ms() + int(self.settings.gateway.request_timeout_s * 1000))
        until = time.monotonic() + (bound_ms - now_ms()) / 1000
        return self._track(self._deliver(topic.at(self.settings.kafka), value, key.encode(), until,
                                         what))

    def publish_soon(self, topic: Topic, record: Any, key: str, *,
                     what: str = "an event") -> asyncio.Task[bool]:
        """Produce ``record`` in the background, once: never fails or slows the
        caller; a record Kafka does not take is dropped with a (rate-limited)
        warning. The task's result says whether it was written."""
        return self._track(self._send_once(topic, record, key, what))

    async def drain(self, within_s: float | None = None) -> None:
        """Wait for the background sends, at most ``within_s`` (default
        ``produce_timeout_s``); those still waiting then are given up, in one line."""
        within = self.settings.gateway.produce_timeout_s if within_s is None else within_s
        pending = set(self._pending)
        if not pending:
            return
        _, left = await asyncio.wait(pending, timeout=within)
        for task in left:
            task.cancel()
        if left:
            log.warning("%d background sends to Kafka not delivered when the gateway "
                        "stopped (waited %.1f s)", len(left), within)
        await asyncio.gather(*left, return_exceptions=True)

    async def close(self, within_s: float | None = None) -> None:
        """Drain the background sends, then stop the producer."""
        try:
            await self.drain(within_s)
        finally:
            await self.producer.stop()

    # -- the background sends ------------------------------------------------------

    def _track(self, work: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        task = asyncio.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _deliver(self, topic: str, value: bytes, key: bytes, until: float,
                       what: str) -> bool:
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        kind = f"deliver:{topic}"
        while True:
            try:
                await self._attempt(topic, value, key, until, kind, what)
            except _PastBound:
                break
            except _BROKER_FAILURES as exc:
                error = broker_error(exc)
                if isinstance(error, PermanentBrokerError):
                    log.error("%s to %s refused by Kafka for good: %s", what, topic, error)
                    return False
                self.problems.warning(kind, "%s to %s not delivered yet, retrying: %s",
                                      what, topic, error)
                delay = backoff.next_delay()
                if time.monotonic() + delay >= until:
                    break
                await asyncio.sleep(delay)
            else:
                self.problems.resolved(kind, "%s to %s delivered after a wait", what, topic)
                return True
        self.problems.warning(f"gave-up:{topic}", "%s to %s given up: Kafka did not take it "
                              "before its deadline", what, topic)
        return False

    async def _attempt(self, topic: str, value: bytes, key: bytes, until: float, kind: str,
                       what: str) -> None:
        """One send, waited for until ``until`` (:class:`_PastBound` then), never sent
        twice while it waits: aiokafka may hold a record for as long as the broker
        is gone. A warning each ``produce_timeout_s`` it is still waiting."""
        send = asyncio.ensure_future(
            self.producer.send_and_wait(topic, value, key=key, headers=None))
        try:
            while True:
                left = until - time.monotonic()
                if left <= 0:
                    raise _PastBound
                done, _ = await asyncio.wait(
                    {send}, timeout=min(left, self.settings.gateway.produce_timeout_s))
                if done:
                    send.result()
                    return
                self.problems.warning(kind, "%s to %s not taken by Kafka yet, still waiting",
                                      what, topic)
        finally:
            if not send.done():
                send.cancel()

    async def _send_once(self, topic: Topic, record: Any, key: str, what: str) -> bool:
        name = topic.at(self.settings.kafka)
        try:
            value = topic.encode(self.codec, record)
            await self.producer.send_and_wait(name, value, key=key.encode(), headers=None)
        except _DROPPED as exc:  # the caller has gone on
            self.problems.warning(f"dropped:{name}", "%s not written to %s: %s", what, name,
                                  exc if isinstance(exc, SchemaError) else broker_error(exc))
            return False
        return True


"""A producer on librdkafka (``confluent-kafka``), behind the interface of
:class:`topics.producer.Producer`: chosen with ``CONVEYOR_KAFKA_PRODUCER=librdkafka``.

Why: aiokafka builds and writes each produce request in Python on the event
loop, a large share of a layer process's CPU in ``bench.profile``. librdkafka
batches and writes in its own C threads, and keeps idempotence across broker
trouble itself (it bumps the producer epoch where aiokafka's session breaks
for good, see topics/producer.py). Not the default: on two shared cores its
threads cost more than they saved (docs/decisions/0012-aiokafka-not-librdkafka.md).

How: ``produce`` queues the record in librdkafka and returns an asyncio
future at once. One thread calls ``poll``, which runs the delivery
callbacks; each callback only notes the outcome, and after each poll the
thread hands all of them to the event loop in one ``call_soon_threadsafe``
(a wake-up costs a system call: one for a poll's worth of acknowledgements,
not one each). A full local queue (``BufferError``) waits and tries again.

Errors come out as Conveyor's (:mod:`conveyor.errors`): too large is
:class:`~topics.clients.EventTooLarge`, a retriable error or a delivery
timed out (the broker unreachable for ``message.timeout.ms``) is
:class:`TransientBrokerError`, the rest :class:`PermanentBrokerError`; so
:meth:`workers.outputs.Sender.produce` retries and dead-letters as it does
for aiokafka. A fatal error (the idempotent session cannot go on) retires
the producer: the next send starts a fresh one, as topics/producer.py does.

The partitioner is ``murmur2_random``, the Java client's and aiokafka's: a
key lands on the same partition whichever producer wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

from conveyor.errors import BrokerError, PermanentBrokerError, TransientBrokerError
from topics.backoff import Backoff

__all__ = ["RdProducer", "RecordMeta", "rd_config", "translate"]

log = logging.getLogger(__name__)

_POLL_S = 0.05
_FULL_WAIT_S = 0.002


@dataclass(frozen=True)
class RecordMeta:
    """Where a record was written (as aiokafka's RecordMetadata names it)."""

    topic: str
    partition: int
    offset: int
    timestamp: int


def rd_config(bootstrap: str, *, idempotent: bool, linger_ms: int, compression: str,
              max_event_bytes: int, request_timeout_ms: int = 30000) -> dict[str, Any]:
    """librdkafka's settings for Conveyor's producer (those of topics/clients.py)."""
    return {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "enable.idempotence": idempotent,
        "linger.ms": linger_ms,
        "compression.type": compression,
        "message.max.bytes": max_event_bytes + 1024,
        "request.timeout.ms": request_timeout_ms,
        # a record the broker has not taken in this long fails (transient)
        "message.timeout.ms": request_timeout_ms,
        "partitioner": "murmur2_random",
        "socket.nagle.disable": True,
        "log_level": 3,
    }


def translate(error: Any) -> BrokerError:
    """A librdkafka ``KafkaError`` as Conveyor's."""
    from confluent_kafka import KafkaError

    from topics.clients import EventTooLarge

    text = f"{error.name()}: {error.str()}"
    code = error.code()
    if code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE):
        return EventTooLarge(text)
    if error.retriable() or error.fatal() or code in (
            KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
            KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT, KafkaError._QUEUE_FULL,
            KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
            KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION):
        return TransientBrokerError(text)
    return PermanentBrokerError(text)


class RdProducer:
    """``send``, ``send_and_wait``, ``flush``, ``partitions_for``, ``start`` and
    ``stop`` of :class:`topics.producer.Producer`, on librdkafka."""

    def __init__(self, config: dict[str, Any], *, start_timeout_s: float = 30.0) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.renewals = 0
        self._producer: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # outcomes noted by delivery callbacks (the poll thread), handed over in batches
        self._outcomes: deque[tuple[asyncio.Future[Any], Any, Any]] = deque()
        self._outstanding: set[asyncio.Future[Any]] = set()
        self._fatal: BaseException | None = None
        self._retired: list[Any] = []

    async def start(self) -> None:
        """Connect: the broker's metadata is read once, so an unreachable broker
        fails the start as aiokafka's does."""
        self._loop = asyncio.get_running_loop()
        self._open()
        try:
            await asyncio.to_thread(self._producer.list_topics, None, self.start_timeout_s)
        except Exception as exc:
            await self.stop()
            raise TransientBrokerError(f"cannot reach Kafka: {exc}") from exc

    def _open(self) -> None:
        from confluent_kafka import Producer as RawProducer

        # librdkafka's own log lines go to Python's logging, not to stderr
        self._producer = RawProducer({**self.config, "error_cb": self._on_error,
                                      "logger": logging.getLogger("librdkafka")})
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(self._producer, self._stopping),
                                        name="rdkafka-poll", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        await self.flush()
        self._close_current()
        for old in self._retired:
            await asyncio.to_thread(old.flush, 5)
        self._retired.clear()

    def _close_current(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    async def flush(self) -> None:
        """Wait until everything sent so far is acknowledged or failed."""
        if self._outstanding:
            await asyncio.gather(*list(self._outstanding), return_exceptions=True)

    async def partitions_for(self, topic: str) -> set[int]:
        """The topic's partitions, asking again while the broker does not know
        the topic yet (as aiokafka's producer waits on its metadata): a topic
        created a moment ago reaches a broker's metadata cache a little later."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        backoff = Backoff(initial_s=0.05, max_s=1.0)
        while True:
            left = max(0.1, deadline - loop.time())
            metadata = await asyncio.to_thread(self._producer.list_topics, topic, left)
            found = metadata.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                return set(found.partitions)
            pause = backoff.next_delay()
            if loop.time() + pause >= deadline:
                raise TransientBrokerError(f"no metadata for {topic}: "
                                           f"{None if found is None else found.error}")
            await asyncio.sleep(pause)

    async def send_and_wait(self, topic: str, value: bytes | None = None,
                            key: bytes | None = None, partition: int | None = None,
                            timestamp_ms: int | None = None,
                            headers: list[tuple[str, bytes]] | None = None) -> RecordMeta:
        fut = await self.send(topic, value, key, partition, timestamp_ms, headers)
        meta: RecordMeta = await fut
        return meta

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                   partition: int | None = None, timestamp_ms: int | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future[Any]:
        """Queue one record; the future resolves with its :class:`RecordMeta` or a
        Conveyor error."""
        from confluent_kafka import KafkaException

        if self._fatal is not None:
            self._renew()
        assert self._loop is not None, "start() the producer first"
        fut: asyncio.Future[Any] = self._loop.create_future()
        callback = partial(self._delivered, fut)
        while True:
            try:
                self._producer.produce(topic, value, key,
                                       partition=-1 if partition is None else partition,
                                       on_delivery=callback, timestamp=timestamp_ms or 0,
                                       headers=headers)
                break
            except BufferError:  # librdkafka's local queue is full: let it drain
                await asyncio.sleep(_FULL_WAIT_S)
            except KafkaException as exc:
                raise translate(exc.args[0]) from exc
        self._outstanding.add(fut)
        fut.add_done_callback(self._outstanding.discard)
        return fut

    # -- the poll thread -------------------------------------------------------

    def _poll(self, producer: Any, stopping: threading.Event) -> None:
        outcomes = self._outcomes
        while True:
            producer.poll(_POLL_S)
            if outcomes:
                batch = []
                while outcomes:
                    batch.append(outcomes.popleft())
                self._hand_over(batch)
            if stopping.is_set() and len(producer) == 0:
                return

    def _hand_over(self, batch: list[tuple[asyncio.Future[Any], Any, Any]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(_settle_all, batch)

    def _delivered(self, fut: asyncio.Future[Any], error: Any, message: Any) -> None:
        """A delivery callback (in the poll thread): note it, nothing more."""
        self._outcomes.append((fut, error, message))

    def _on_error(self, error: Any) -> None:
        if error.fatal():
            self._fatal = translate(error)
            log.warning("Kafka producer (librdkafka): fatal error %s; the next send "
                        "starts a fresh producer", error)
        else:
            log.debug("Kafka producer (librdkafka): %s", error)

    def _renew(self) -> None:
        log.warning("Kafka producer (librdkafka): continuing on a fresh producer after %r",
                    self._fatal)
        self._fatal = None
        self._retired.append(self._producer)
        self._close_current()
        self._open()
        self.renewals += 1


def _settle_all(batch: list[tuple[asyncio.Future[Any], Any, Any]]) -> None:
    for fut, error, message in batch:
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(translate(error))
        else:
            timestamp = message.timestamp()
            fut.set_result(RecordMeta(message.topic(), message.partition(), message.offset(),
                                      timestamp[1] if timestamp else -1))


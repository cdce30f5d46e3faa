"""Kafka client factories with Conveyor's production settings (producers:
acks=all, idempotent, events up to ``max_event_bytes``; consumers: manual
commits, fetches answered at the first record), and :func:`broker_error`, the
boundary where aiokafka's errors become Conveyor's: transient (retry with
backoff; a refused producer id or sequence included, its producer is
replaced) or permanent (give up on the event and dead-letter it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import errors as kafka_errors

from conveyor.errors import BrokerError, PermanentBrokerError, TransientBrokerError
from conveyor.settings import KafkaSettings
from topics.producer import Producer, breaks_sequence

__all__ = ["PRODUCE_TIMEOUT_MS", "IDLE_FETCH_WAIT_MS", "make_producer", "make_consumer",
           "hold_fetches", "stop_consumer", "broker_error", "EventTooLarge", "Producer",
           "KafkaError", "KafkaConnectionError", "NotAssigned", "COMMIT_REFUSED", "BROKER_TROUBLE"]

log = logging.getLogger(__name__)

# The client's errors, for the except clauses of code outside topics/: this module
# is the one that imports aiokafka's errors, and broker_error() says what they mean.
KafkaError = kafka_errors.KafkaError
KafkaConnectionError = kafka_errors.KafkaConnectionError
# what a client raises while the broker is unreachable or failing
BROKER_TROUBLE = (KafkaError, OSError, TimeoutError)
# an operation on a partition the consumer no longer holds
NotAssigned = kafka_errors.IllegalStateError
# a commit the group refused: a rebalance gave the partition to another member
COMMIT_REFUSED: tuple[type[Exception], ...] = (kafka_errors.CommitFailedError,
                                               kafka_errors.IllegalStateError)

# Errors aiokafka does not flag ``retriable`` that still pass with time.
_TRANSIENT = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.BrokerNotAvailableError,
    kafka_errors.RequestTimedOutError,
    kafka_errors.NotEnoughReplicasError,
    kafka_errors.NotEnoughReplicasAfterAppendError,
    kafka_errors.LeaderNotAvailableError,
    kafka_errors.NotLeaderForPartitionError,
    kafka_errors.KafkaUnavailableError,
)
_TOO_LARGE = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
)


class EventTooLarge(PermanentBrokerError):
    """An event larger than a topic or the producer takes (``max_event_bytes``)."""


def broker_error(exc: BaseException) -> BrokerError:
    """Translate an aiokafka error (or a Conveyor one, kept as is) into
    "retry" (:class:`TransientBrokerError`) or "give up"
    (:class:`PermanentBrokerError`, :class:`EventTooLarge` for size)."""
    if isinstance(exc, BrokerError):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, _TOO_LARGE):
        return EventTooLarge(text)
    if isinstance(exc, _TRANSIENT) or breaks_sequence(exc) or (
            isinstance(exc, kafka_errors.KafkaError) and exc.retriable):
        return TransientBrokerError(text)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return TransientBrokerError(text)
    return PermanentBrokerError(text)


# how long a producer holds a record before it fails its send (a partition
# without a leader: a broker restarting); the record keeps the time it was
# sent at (its CreateTime), so it can land this much later than that time says
PRODUCE_TIMEOUT_MS = 30_000


def make_producer(kafka: KafkaSettings, **overrides: Any) -> Producer:
    """Conveyor's producer on aiokafka; ``overrides`` are aiokafka's option names."""
    options: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap,
        "acks": "all",
        "enable_idempotence": kafka.producer_idempotent,
        "linger_ms": kafka.producer_linger_ms,
        "compression_type": None if kafka.producer_compression == "none"
        else kafka.producer_compression,
        "request_timeout_ms": PRODUCE_TIMEOUT_MS,
        "max_batch_size": 1 << 20,
        "max_request_size": kafka.max_event_bytes,
    }
    options.update(overrides)
    return Producer(lambda: AIOKafkaProducer(**options))


# how long the broker holds an idle consumer's fetch (a record ends it at once)
IDLE_FETCH_WAIT_MS = 500


def hold_fetches(consumer: AIOKafkaConsumer, max_wait_ms: int, min_bytes: int) -> None:
    """How the broker holds ``consumer``'s next fetches: until ``min_bytes`` are
    there or ``max_wait_ms`` passed. aiokafka reads the two at each fetch it
    builds, from its fetcher's private fields (no public way to change them
    after the start; tests/unit/topics/test_hold_fetches.py pins them)."""
    fetcher = consumer._fetcher
    fetcher._fetch_max_wait_ms = max_wait_ms
    fetcher._fetch_min_bytes = min_bytes


def make_consumer(
    kafka: KafkaSettings, *topics: str, group: str | None = None, **overrides: Any
) -> AIOKafkaConsumer:
    options: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap,
        "group_id": group,
        # what a group's member is called (conveyor groups, the console): its
        # layer and its process
        "client_id": f"{(group or 'reader').removeprefix(kafka.topic_prefix + '.')}"
                     f"-{os.getpid()}",
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "fetch_min_bytes": 1,
        # the broker answers a fetch as soon as one record is there; the wait
        # only bounds how often an idle consumer asks
        "fetch_max_wait_ms": IDLE_FETCH_WAIT_MS,
        "session_timeout_ms": kafka.consumer_session_timeout_ms,
        "heartbeat_interval_ms": kafka.consumer_heartbeat_interval_ms,
        "max_poll_interval_ms": 300000,
        "isolation_level": "read_uncommitted",
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


async def stop_consumer(consumer: Any, within: float | None = None) -> None:
    """Stop ``consumer`` in ``within`` seconds at most (None: no bound); a failed
    stop is logged, never raised. A consumer whose group join is in flight (its
    start gave up) would otherwise wait for the broker to answer the JoinGroup
    request, up to its request timeout (40 s). The stop runs as a task of its
    own, never under ``wait_for``: aiokafka's ``stop`` may raise its fetch task's
    CancelledError (not ours), or swallow our cancel against a broker that is
    gone and hold the caller's own cancel for ever; past the bound, or on a
    cancel, it is left to end on its own."""
    stopping = asyncio.ensure_future(consumer.stop())
    try:
        done, _ = await asyncio.wait({stopping}, timeout=within)
    except asyncio.CancelledError:
        _abandon(stopping)
        raise
    if not done:
        _abandon(stopping)
        log.debug("closing a consumer took over %.1f s; left to end on its own", within)
    elif not stopping.cancelled() and stopping.exception() is not None:
        log.debug("closing a consumer failed: %r", stopping.exception())


def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and let it end on its own (its outcome read, never raised)."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())

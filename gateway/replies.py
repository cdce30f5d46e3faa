"""The gateway's reply path: a leased reply partition and the streams waiting on it.

Each gateway instance leases one partition of ``conveyor.replies`` in Redis
(``SET NX PX``, renewed by a background task), so that every reply of a
request lands on the instance that holds its connection. It reads that
partition directly (assigned, no consumer group) from the end, and hands each
reply to the :class:`ReplyStream` of its request. Replies carry an index:
repeats (after a layer replayed its log) are dropped, and early ones wait.

The lease key is ``{prefix}:reply-lease:{partition}`` and its value is the
gateway id: infer workers read it to learn whether the gateway a generation
answers to is still alive. Both background tasks outlive an outage of the
service under them. The lease retries a Redis that does not answer with
backoff (``retry_backoff_max_s``), and takes its partition again with
``SET NX`` when the key is gone (Redis restarted without its data, or was
flushed); only another gateway holding the partition is a failure that
retrying does not cure, and it shows in health as ``failed``. The follower
retries Kafka errors the same way, and reads the broker's silence (no fetch
answer for :data:`ReplyRouter.silent_after_s`) as Kafka being unreachable,
which health shows and :class:`~gateway.serving.Serving` uses to refuse new
requests at once instead of letting them wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from redis.exceptions import RedisError

from conveyor.errors import BrokerError, DeadlineExceeded, RequestError, SchemaError
from conveyor.settings import Settings
from gateway.health import TaskHealth
from schemas.codec import Codec
from schemas.records import Reply, Usage
from topics.backoff import Backoff
from topics.catalog import REPLIES
from topics.clients import KafkaError, make_consumer

__all__ = ["ReplyRouter", "ReplyStream", "ReplyLease", "ReplySource", "Folded", "fold_answer",
           "reply_error"]

_LATE = "The request did not finish within its deadline."

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class ReplyStream:
    """The replies of one request, in index order."""

    request_id: str
    queue: asyncio.Queue[Reply] = field(default_factory=asyncio.Queue)
    next_index: int = 0
    early: dict[int, Reply] = field(default_factory=dict)

    async def next(self, deadline: float, within: float | None = None) -> Reply | None:
        """The next reply: one already here at once; else wait for it until
        ``deadline`` (``time.monotonic()``), DeadlineExceeded after it, or for
        ``within`` seconds, None when they passed first."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(_LATE)
        try:
            return await asyncio.wait_for(self.queue.get(),
                                          left if within is None else min(within, left))
        except TimeoutError:
            if within is not None and time.monotonic() < deadline:
                return None
            raise DeadlineExceeded(_LATE) from None

    def put(self, reply: Reply) -> None:
        index = reply["index"]
        if index < self.next_index or index in self.early:
            return
        self.early[index] = reply
        while self.next_index in self.early:
            self.queue.put_nowait(self.early.pop(self.next_index))
            self.next_index += 1


def reply_error(reply: Reply) -> RequestError:
    """What an ``error`` reply answers the client with."""
    err = reply["error"]
    if err is None:
        return RequestError("The request failed.")
    return RequestError(err["message"], param=err["param"], code=err["code"],
                        status=err["status"], type=err["type"])


class ReplySource(Protocol):
    """What a request's replies are read from: a live answer or recorded replies."""

    @property
    def request_id(self) -> str: ...

    async def next(self, within: float | None = None) -> Reply | None: ...


@dataclass
class Folded:
    """A whole answer: its text, why it ended and what it used."""

    text: str
    finish_reason: str | None
    usage: Usage | None


async def fold_answer(source: ReplySource, within: float | None = None,
                      idle: Callable[[], Awaitable[bool]] | None = None) -> Folded | None:
    """Read ``source`` to its final reply. ``idle`` is asked whenever ``within``
    passes without a reply; True gives up (None). An error reply raises."""
    text: list[str] = []
    finish: str | None = None
    while True:
        reply = await source.next(within)
        if reply is None:
            if idle is not None and await idle():
                return None
            continue
        if reply["text"]:
            text.append(reply["text"])
        if reply["finish_reason"]:
            finish = reply["finish_reason"]
        if reply["kind"] == "final":
            return Folded("".join(text), finish, reply["usage"])


class ReplyLease:
    def __init__(self, settings: Settings, redis: aioredis.Redis, gateway_id: str,
                 health: TaskHealth | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.gateway_id = gateway_id
        self.partition: int | None = None
        self.health = health or TaskHealth("reply-lease")
        self._ttl_ms = int(settings.reply_lease_ttl_s * 1000)
        self._renew_every_s = settings.reply_lease_ttl_s / 3

    def _key(self, partition: int) -> str:
        return f"{self.settings.topic_prefix}:reply-lease:{partition}"

    async def acquire(self) -> int:
        n = self.settings.reply_partitions
        start = hash(self.gateway_id) % n
        for i in range(n):
            p = (start + i) % n
            if await self.redis.set(self._key(p), self.gateway_id, nx=True, px=self._ttl_ms):
                self.partition = p
                self.health.set("ok", f"partition {p}")
                return p
        raise BrokerError(f"all {n} reply partitions are leased by other gateways")

    async def keep(self) -> None:
        """Renew the lease until cancelled. Redis errors are retried with backoff
        (health ``degraded``); a vanished key is taken again; a partition held by
        another gateway is ``failed`` and retried at the renewal pace."""
        assert self.partition is not None
        retry = Backoff(max_s=min(self.settings.retry_backoff_max_s, self._renew_every_s))
        pause = self._renew_every_s
        while True:
            await asyncio.sleep(pause)
            pause = retry.next_delay()
            try:
                await asyncio.wait_for(self.renew(), timeout=max(1.0, self._renew_every_s))
            except (RedisError, OSError, TimeoutError) as exc:
                if self.health.set("degraded", f"Redis unreachable: {exc!r}"):
                    log.warning("reply lease on partition %d: Redis unreachable (%r); "
                                "retrying", self.partition, exc)
            except Exception as exc:  # not an outage: show it, keep trying
                if self.health.set("failed", f"{exc!r}"):
                    log.exception("reply lease on partition %d failed", self.partition)
            else:
                retry.reset()
                pause = self._renew_every_s

    async def renew(self) -> None:
        """One renewal: extend our key, or take it again if it is gone."""
        assert self.partition is not None
        key = self._key(self.partition)
        renewed = await self.redis.eval(  # type: ignore[misc]
            _RENEW, 1, key, self.gateway_id, self._ttl_ms)
        if not renewed and await self.redis.set(key, self.gateway_id, nx=True,
                                                px=self._ttl_ms):
            log.warning("reply lease on partition %d was gone (Redis lost it or it "
                        "lapsed); taken again", self.partition)
            renewed = True
        if renewed:
            if self.health.set("ok", f"partition {self.partition}"):
                log.info("reply lease on partition %d: renewed again", self.partition)
            return
        holder = await self.redis.get(key)
        holder_id = holder.decode(errors="replace") if isinstance(holder, bytes) else holder
        if self.health.set("failed", f"partition {self.partition} is leased by {holder_id}"):
            log.error("reply partition %d is leased by gateway %s: replies of this "
                      "gateway's requests may go to it", self.partition, holder_id)

    async def release(self) -> None:
        if self.partition is not None:
            with contextlib.suppress(Exception):
                await self.redis.eval(  # type: ignore[misc]
                    _RELEASE, 1, self._key(self.partition), self.gateway_id)


class ReplyRouter:
    #: no fetch answer from the broker for this long means Kafka is unreachable
    #: (an idle partition is still answered every ``fetch_max_wait_ms``, 500 ms)
    silent_after_s: float = 5.0

    def __init__(self, settings: Settings, codec: Codec, lease: ReplyLease,
                 health: TaskHealth | None = None) -> None:
        self.settings = settings
        self.codec = codec
        self.lease = lease
        self.health = health or TaskHealth("replies")
        self.streams: dict[str, ReplyStream] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._tp: TopicPartition | None = None
        self._running_since = time.time()

    @property
    def partition(self) -> int:
        assert self.lease.partition is not None
        return self.lease.partition

    def open(self, request_id: str) -> ReplyStream:
        stream = ReplyStream(request_id)
        self.streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def start(self) -> None:
        partition = await self.lease.acquire()
        consumer = make_consumer(self.settings, group=None)
        await consumer.start()
        tp = TopicPartition(REPLIES.at(self.settings), partition)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)  # resolve now: replies from here on are ours
        self._consumer, self._tp = consumer, tp

    def kafka_unreachable(self) -> bool:
        """True while the broker has not answered a fetch for ``silent_after_s``."""
        return self.health.state == "degraded"

    async def run(self) -> None:
        """Hand every reply to its stream, until cancelled; Kafka errors are retried
        with backoff and never end the task."""
        consumer = self._consumer
        assert consumer is not None
        self._running_since = time.time()
        retry = Backoff(max_s=self.settings.retry_backoff_max_s)
        while True:
            try:
                batch = await consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                self._degraded(f"Kafka error: {exc!r}")
                await retry.wait()
                continue
            except Exception as exc:  # not an outage: show it, keep trying
                if self.health.set("failed", f"{exc!r}"):
                    log.exception("reply follower on partition %d failed", self.partition)
                await retry.wait()
                continue
            retry.reset()
            self._check_fetching()
            for records in batch.values():
                for record in records:
                    self._dispatch(record.value, record.offset)

    def _check_fetching(self) -> None:
        consumer, tp = self._consumer, self._tp
        assert consumer is not None and tp is not None
        try:
            last_ms = consumer.last_poll_timestamp(tp)
        except Exception:  # no fetch answer yet
            last_ms = None
        last = last_ms / 1000 if last_ms else self._running_since
        silent = time.time() - last
        if silent > self.silent_after_s:
            self._degraded(f"no answer from Kafka for {silent:.0f} s")
        elif last_ms and self.health.set("ok", f"partition {self.partition}"):
            log.info("reply follower on partition %d: Kafka answers again", self.partition)

    def _degraded(self, detail: str) -> None:
        if self.health.set("degraded", detail):
            log.warning("reply follower on partition %d: %s; retrying", self.partition,
                        detail)

    def _dispatch(self, value: bytes | None, offset: int) -> None:
        try:
            reply: Reply = self.codec.decode(value, "Reply")
        except SchemaError as exc:
            log.warning("ignoring a bad reply at %d: %s", offset, exc)
            return
        stream = self.streams.get(reply["envelope"]["request_id"])
        if stream is not None:
            stream.put(reply)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        await self.lease.release()

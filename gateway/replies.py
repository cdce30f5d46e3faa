"""The gateway's reply path: a leased reply partition and the streams waiting on it.

Each gateway instance leases one partition of ``conveyor.replies`` in Redis
(``SET NX PX``, renewed by a background task), so that every reply of a
request lands on the instance that holds its connection. It reads that
partition directly (assigned, no consumer group) from the end, and hands each
reply to the :class:`ReplyStream` of its request. Replies carry an index:
repeats (after a layer replayed its log) are dropped, and early ones wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition

from conveyor.errors import BrokerError, SchemaError
from conveyor.settings import Settings
from schemas.codec import Codec
from schemas.records import Reply
from topics.clients import make_consumer

__all__ = ["ReplyRouter", "ReplyStream", "ReplyLease"]

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

    def put(self, reply: Reply) -> None:
        index = reply["index"]
        if index < self.next_index or index in self.early:
            return
        self.early[index] = reply
        while self.next_index in self.early:
            self.queue.put_nowait(self.early.pop(self.next_index))
            self.next_index += 1


class ReplyLease:
    def __init__(self, settings: Settings, redis: aioredis.Redis, gateway_id: str) -> None:
        self.settings = settings
        self.redis = redis
        self.gateway_id = gateway_id
        self.partition: int | None = None
        self._ttl_ms = int(settings.reply_lease_ttl_s * 1000)

    def _key(self, partition: int) -> str:
        return f"{self.settings.topic_prefix}:reply-lease:{partition}"

    async def acquire(self) -> int:
        n = self.settings.reply_partitions
        start = hash(self.gateway_id) % n
        for i in range(n):
            p = (start + i) % n
            if await self.redis.set(self._key(p), self.gateway_id, nx=True, px=self._ttl_ms):
                self.partition = p
                return p
        raise BrokerError(f"all {n} reply partitions are leased by other gateways")

    async def keep(self) -> None:
        """Renew the lease until cancelled; losing it is a failure that surfaces."""
        assert self.partition is not None
        while True:
            await asyncio.sleep(self.settings.reply_lease_ttl_s / 3)
            renewed = await self.redis.eval(  # type: ignore[misc]
                _RENEW, 1, self._key(self.partition), self.gateway_id, self._ttl_ms)
            if not renewed:
                raise BrokerError(f"lost the lease on reply partition {self.partition}")

    async def release(self) -> None:
        if self.partition is not None:
            with contextlib.suppress(Exception):
                await self.redis.eval(  # type: ignore[misc]
                    _RELEASE, 1, self._key(self.partition), self.gateway_id)


class ReplyRouter:
    def __init__(self, settings: Settings, codec: Codec, lease: ReplyLease) -> None:
        self.settings = settings
        self.codec = codec
        self.lease = lease
        self.streams: dict[str, ReplyStream] = {}
        self._consumer: AIOKafkaConsumer | None = None

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
        tp = TopicPartition(self.settings.topic("replies"), partition)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)  # resolve now: replies from here on are ours
        self._consumer = consumer

    async def run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                for record in records:
                    try:
                        reply: Reply = self.codec.decode(record.value, "Reply")
                    except SchemaError as exc:
                        log.warning("ignoring a bad reply at %d: %s", record.offset, exc)
                        continue
                    stream = self.streams.get(reply["envelope"]["request_id"])
                    if stream is not None:
                        stream.put(reply)

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        await self.lease.release()

"""What an earlier attempt at a task already sent, so that a retry continues it.

The tokens a client has seen are in ``conveyor.tokens``: that log, not a side
store, is the record. Taking a task, a worker claims it in Redis (one
round trip when it starts and one when it ends, nothing per chunk) and holds
a short lease on it, renewed while it runs. When the claim exists
already, the task is a redelivery: the worker reads the request's partition
of ``conveyor.tokens`` from postprocess's committed offset (postprocess never
commits past the first chunk of a request still open) to the end, and
continues after the chunks it finds, with the next sequence number and the
text so far, so the client sees one answer, not the start of a second one.

The lease tells a retry from a duplicate: a task whose lease another worker
holds is running there (an upstream layer delivered it twice), so this
worker waits until that one ends or its lease lapses (the holder died)
instead of generating the same answer a second time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner

from conveyor.errors import BrokerError
from conveyor.settings import Settings
from schemas.codec import Codec
from schemas.records import TokenChunk
from topics.clients import make_consumer

__all__ = ["Progress", "ProgressTracker", "progress_of"]

log = logging.getLogger(__name__)

_DONE = b"done:"
_STARTED = b"started:"


@dataclass(frozen=True)
class Progress:
    next_seq: int = 0
    text: str = ""
    tokens: int = 0
    finished: bool = False


def progress_of(chunks: list[TokenChunk]) -> Progress:
    """The progress the chunks of one request add up to (in sequence, repeats ignored)."""
    by_seq = {c["seq"]: c for c in chunks}
    seq, text, tokens, finished = 0, [], 0, False
    while seq in by_seq and not finished:
        chunk = by_seq[seq]
        text.append(chunk["text"])
        tokens += chunk["tokens"]
        finished = chunk["finish_reason"] is not None or chunk["error"] is not None
        seq += 1
    return Progress(seq, "".join(text), tokens, finished)


class ProgressTracker:
    def __init__(self, settings: Settings, redis: aioredis.Redis, codec: Codec,
                 producer: AIOKafkaProducer) -> None:
        self.settings = settings
        self.redis = redis
        self.codec = codec
        self.producer = producer  # knows the topics' partitions (as it partitions by key)

    def _key(self, request_id: str) -> str:
        return f"{self.settings.topic_prefix}:claim:{request_id}"

    def _lease(self, request_id: str) -> str:
        return f"{self.settings.topic_prefix}:lease:{request_id}"

    async def claim(self, request_id: str, worker_id: str
                    ) -> Literal["first", "retry", "done", "busy"]:
        """Take the task's lease, and say what its history is: ``first`` (never
        started), ``retry`` (started, nobody runs it now: continue from the log),
        ``done`` (it ended; only its offset was left to commit) or ``busy``
        (another worker holds the lease: a duplicate of a running task)."""
        key, lease = self._key(request_id), self._lease(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, _STARTED + worker_id.encode(), nx=True, ex=self.settings.progress_ttl_s)
            pipe.get(key)
            pipe.set(lease, worker_id, nx=True, ex=self.settings.claim_lease_s)
            created, state, leased = await pipe.execute()
        if created:
            return "first"
        if isinstance(state, bytes) and state.startswith(_DONE):
            return "done"
        return "retry" if leased else "busy"

    async def keep(self, request_ids: list[str], worker_id: str) -> None:
        """Renew the leases of the tasks this worker runs (every lease_s / 4)."""
        if not request_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.set(self._lease(rid), worker_id, ex=self.settings.claim_lease_s)
            await pipe.execute()

    async def release(self, request_id: str) -> None:
        """Give the lease up (the task was handed off): its next owner need not wait."""
        await self.redis.delete(self._lease(request_id))

    async def finish(self, request_id: str, worker_id: str) -> None:
        """Record that the task ended and every chunk of it is in the log."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self._key(request_id), _DONE + worker_id.encode(),
                     ex=self.settings.progress_ttl_s)
            pipe.delete(self._lease(request_id))
            await pipe.execute()

    async def recover(self, request_id: str) -> Progress:
        """Read back what earlier attempts put on ``conveyor.tokens``."""
        chunks = await self._chunks_of(request_id)
        return progress_of(chunks)

    async def _chunks_of(self, request_id: str) -> list[TokenChunk]:
        topic = self.settings.topic("tokens")
        partitions = sorted(await self.producer.partitions_for(topic))
        if not partitions:
            raise BrokerError(f"topic {topic} has no partitions")
        consumer = make_consumer(self.settings, group=None)
        await consumer.start()
        try:
            key = request_id.encode()
            tp = TopicPartition(topic, DefaultPartitioner()(key, partitions, partitions))
            consumer.assign([tp])
            start = await self._postprocess_position(tp)
            end = (await consumer.end_offsets([tp]))[tp]
            if start is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, start)
            found: list[TokenChunk] = []
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                for record in batch.get(tp, []):
                    if record.key == key:
                        found.append(self.codec.decode(record.value, "TokenChunk"))
            log.info("recovered %d chunks of %s from %s offsets %s..%s", len(found),
                     request_id, tp, start, end)
            return found
        finally:
            await consumer.stop()

    async def _postprocess_position(self, tp: TopicPartition) -> int | None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(
                self.settings.group("postprocess"), partitions=[tp])
        finally:
            await admin.close()
        meta = offsets.get(tp)
        return meta.offset if meta is not None and meta.offset >= 0 else None

"""What a generation has already sent, kept in Redis so that a retry continues it.

After each chunk is acknowledged by Kafka the worker records the next
sequence number, the text so far and the token count. A worker that takes a
redelivered task reads it and continues after that text, so the client sees
one answer, not the start of a second, different one.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

__all__ = ["Progress", "ProgressStore"]


@dataclass(frozen=True)
class Progress:
    next_seq: int = 0
    text: str = ""
    tokens: int = 0
    finished: bool = False
    worker_id: str = ""


class ProgressStore:
    def __init__(self, client: aioredis.Redis, prefix: str, ttl_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    def _key(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{request_id}"

    async def load(self, request_id: str) -> Progress:
        raw: dict[bytes, bytes] = await self.client.hgetall(self._key(request_id))  # type: ignore[misc,assignment]
        if not raw:
            return Progress()
        return Progress(
            next_seq=int(raw[b"next_seq"]),
            text=raw[b"text"].decode(),
            tokens=int(raw[b"tokens"]),
            finished=raw.get(b"finished") == b"1",
            worker_id=raw.get(b"worker", b"").decode(),
        )

    async def save(self, request_id: str, progress: Progress) -> None:
        key = self._key(request_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={
                "next_seq": progress.next_seq,
                "text": progress.text,
                "tokens": progress.tokens,
                "finished": "1" if progress.finished else "0",
                "worker": progress.worker_id,
            })
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

"""The exact prompt cache: a repeated request answered without a worker.

An answer that would be the same again (temperature 0 or a fixed seed, no
logprobs) is keyed by the tenant, the resolved model, the prompt's
fingerprint and everything else that shapes the text (:func:`cache_key`).
Preprocess names the key in the task's ``Prompt`` when the policy turns the
cache on; the infer worker that finishes the answer writes it whole; on a hit
preprocess writes it to ``conveyor.tokens`` as one chunk (worker id
``cache``, :func:`hit_chunk`), so postprocess shapes it like any answer.
Entries live ``cache_ttl_s``, at most ``MAX_ENTRIES`` a tenant (due first
dropped first), none longer than ``MAX_TEXT_CHARS``. A lookup that fails or
takes longer than ``_TIMEOUT_S`` is a miss; a write that fails or whose
commands together take longer than ``_WRITE_TIMEOUT_S`` is not kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from conveyor.redis_clients import REDIS_ERRORS, Redis, redis_client
from conveyor.settings import Settings
from schemas.records import ChunkHeader, Envelope, Generation, Prompt, TokenChunk
from schemas.tools import reads_tool_calls
from topics.backoff import RateLimitedLog

__all__ = ["answer_key", "cache_key", "CACHE_WORKER", "cacheable", "Cached", "chunk_header",
           "earliest", "hit_chunk", "outlived_by", "PromptCache"]

log = logging.getLogger(__name__)

CACHE_WORKER = "cache"
MAX_ENTRIES = 10_000
MAX_TEXT_CHARS = 200_000
_TIMEOUT_S = 0.25
_WRITE_TIMEOUT_S = _TIMEOUT_S * 4


def cacheable(generation: Generation) -> bool:
    """Whether the answer would be the same again: greedy or seeded, no logprobs."""
    sampling = generation["sampling"]
    if generation["kind"] == "embedding":  # not kept: an embedding is cheaper than its key
        return False
    return not sampling.get("logprobs") and (
        sampling["temperature"] <= 0 or sampling.get("seed") is not None)


def cache_key(tenant: str, model: str, prompt_fingerprint: str,
              generation: Generation, max_tokens: int) -> str | None:
    """The key of a request's answer, or None when its answer may differ again."""
    if not cacheable(generation):
        return None
    return answer_key(tenant, model, prompt_fingerprint, generation, max_tokens)


def answer_key(tenant: str, model: str, prompt: object, generation: Generation,
               max_tokens: int, *more: object) -> str:
    """``<tenant>:<digest>`` of everything that shapes an answer: the model, the
    ``prompt`` (a fingerprint, or whatever stands for it), the answer's length,
    sampling, response format and tools, and ``more``."""
    sampling = generation["sampling"]
    shape = [generation["kind"], model, prompt, max_tokens,
             {k: v for k, v in sorted(sampling.items()) if k != "max_tokens"},
             generation.get("response_format"), generation.get("tools"), *more]
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode())
    return f"{tenant}:{digest.hexdigest()[:40]}"


@dataclass(frozen=True)
class Cached:
    text: str
    tokens: int
    finish_reason: str
    model: str

    def value(self) -> str:
        return json.dumps({"text": self.text, "tokens": self.tokens,
                           "finish_reason": self.finish_reason, "model": self.model},
                          ensure_ascii=False)

    @classmethod
    def parse(cls, raw: bytes | str) -> Cached | None:
        try:
            data: dict[str, Any] = json.loads(raw)
            return cls(str(data["text"]), int(data["tokens"]), str(data["finish_reason"]),
                       str(data["model"]))
        except (ValueError, KeyError, TypeError):
            return None


async def outlived_by(redis: Redis, index: str, last: list[Any]) -> None:
    """An index scored by expiry lives as long as its longest-lived member
    (``last``: its ``ZRANGE -1 -1 WITHSCORES``), a second more."""
    if last:
        await redis.pexpireat(index, int(float(last[0][1]) * 1000) + 1000)


async def earliest(redis: Redis, index: str, count: int) -> list[Any]:
    """The ``count`` members of an index scored by expiry that expire first,
    taken out of it (none when ``count`` is not over 0)."""
    if count <= 0:
        return []
    popped = await redis.zpopmin(index, count)
    return [entry[0] for entry in popped if isinstance(entry, tuple | list)]


class PromptCache:
    """Entries under ``{prefix}:cache:{tenant}:{digest}``, each tenant's written
    times in ``{prefix}:cache-index:{tenant}``."""

    def __init__(self, settings: Settings, redis: Redis | None = None) -> None:
        self.settings = settings
        self._redis = redis
        self._owned = redis is None
        self._problems = RateLimitedLog(log)

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            self._redis = redis_client(self.settings.redis, "cache")
        return self._redis

    def _entry(self, key: str) -> str:
        return f"{self.settings.kafka.topic_prefix}:cache:{key}"

    def _index(self, key: str) -> str:
        # a key is ``{tenant}:{digest}`` (cache_key) and a digest holds no ':':
        # the tenant is all before the last one, ':' in its id or not
        return f"{self.settings.kafka.topic_prefix}:cache-index:{key.rsplit(':', 1)[0]}"

    async def get(self, key: str) -> Cached | None:
        try:
            raw = await asyncio.wait_for(self.redis.get(self._entry(key)), _TIMEOUT_S)
        except REDIS_ERRORS as exc:
            self._problems.warning("get", "prompt cache: Redis failed (%r); a miss", exc)
            return None
        return None if raw is None else Cached.parse(raw)

    async def get_many(self, keys: list[str]) -> list[Cached | None]:
        """The entries of ``keys`` in one round trip (each None when absent;
        all None when Redis fails)."""
        if not keys:
            return []
        try:
            raws = await asyncio.wait_for(self.redis.mget([self._entry(k) for k in keys]),
                                          _TIMEOUT_S)
        except REDIS_ERRORS as exc:
            self._problems.warning("get", "prompt cache: Redis failed (%r); a miss", exc)
            return [None] * len(keys)
        return [None if raw is None else Cached.parse(raw) for raw in raws]

    async def put(self, key: str, entry: Cached, ttl_s: int) -> bool:
        """Keep ``entry`` (whether it was kept); the tenant's oldest beyond
        ``MAX_ENTRIES`` are dropped."""
        if len(entry.text) > MAX_TEXT_CHARS or ttl_s <= 0:
            return False
        entry_key, index = self._entry(key), self._index(key)
        now = time.time()
        try:
            # one bound for all of it: past it the answer is not kept
            async with asyncio.timeout(_WRITE_TIMEOUT_S):
                await self._write(entry_key, index, entry.value(), ttl_s, now)
        except REDIS_ERRORS as exc:
            self._problems.warning("put", "prompt cache: Redis failed (%r); not kept", exc)
            return False
        return True

    async def _write(self, entry_key: str, index: str, value: str, ttl_s: int,
                     now: float) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(entry_key, value, ex=ttl_s)
            pipe.zadd(index, {entry_key: now + ttl_s})  # scored by when it expires
            pipe.zremrangebyscore(index, "-inf", now)
            pipe.zcard(index)
            pipe.zrange(index, -1, -1, withscores=True)
            *_, size, last = await pipe.execute()
        await outlived_by(self.redis, index, last)
        if members := await earliest(self.redis, index, int(size) - MAX_ENTRIES):
            await self.redis.delete(*members)

    async def close(self) -> None:
        if self._owned and self._redis is not None:
            await self._redis.aclose()
            self._redis = None


def chunk_header(generation: Generation, model: str, prompt: Prompt) -> ChunkHeader:
    """The header of a request's first chunk, a worker's or a cache hit's:
    ``model`` the one that answers, and the one asked for when they differ."""
    ask = generation.get("embedding")
    return ChunkHeader(kind=generation["kind"], model=model, created=generation["created"],
                       asked=generation["model"] if model != generation["model"] else "",
                       stop=generation["sampling"]["stop"], stream=generation["stream"],
                       include_usage=generation["include_usage"],
                       prompt_tokens=prompt["tokens"], tool_calls=reads_tool_calls(generation),
                       logprobs=bool(generation["sampling"].get("logprobs")),
                       encoding_format=ask["encoding_format"] if ask else "")


def hit_chunk(envelope: Envelope, generation: Generation, prompt: Prompt,
              cached: Cached) -> TokenChunk:
    """The whole cached answer as the one chunk of a run, as a worker writes it."""
    return TokenChunk(envelope=envelope, seq=0, text=cached.text, tokens=cached.tokens,
                      finish_reason=cached.finish_reason, worker_id=CACHE_WORKER,
                      header=chunk_header(generation, cached.model, prompt), error=None,
                      run_start=0, run_id=CACHE_WORKER + hashlib.sha256(
                          envelope["request_id"].encode()).hexdigest()[:7],
                      cached_tokens=prompt["tokens"], logprobs=[], embeddings=[])

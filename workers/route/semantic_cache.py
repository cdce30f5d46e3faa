"""The semantic prompt cache: a paraphrase answered without a worker.

When a policy turns it on (``[cache] semantic = true``), route embeds the
prompt's text (:func:`workers.route.meaning.prompt_text`) and looks for the
nearest earlier prompt, by cosine, among those of the same group: the same
tenant, answering model, sampling, format, tools and conversation before the
last user turn (:func:`group_of`). One at least ``similarity`` alike whose
answer is in the exact prompt cache answers: route writes it to
``conveyor.tokens`` as the exact cache's hit is written
(:func:`workers.prompt_cache.hit_chunk`). On a miss route keeps the prompt's
vector beside the exact cache key its answer will be kept under; the infer
worker writes that answer, as for the exact cache, only once it is whole. A
vector whose answer never came (or expired) is passed over.

Redis holds, per group, a hash of exact key -> expiry (8 bytes) and vector
(float32); each tenant's groups are indexed by expiry (at most
``MAX_GROUPS``, each at most ``MAX_VECTORS``). A lookup that fails or whose
read takes longer than ``_TIMEOUT_S`` is a miss; so is a write that fails or
whose commands together take longer than ``_WRITE_TIMEOUT_S``, not kept.
Only answers that would be the same again are kept (:func:`workers.prompt_cache.cacheable`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.redis_clients import REDIS_ERRORS, Redis, redis_client, text
from conveyor.settings import Settings
from schemas.records import Generation
from topics.backoff import RateLimitedLog
from workers.prompt_cache import Cached, PromptCache, answer_key, earliest, outlived_by

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MAX_GROUPS", "MAX_VECTORS", "SemanticCache", "SemanticHit", "group_of"]

log = logging.getLogger(__name__)

MAX_GROUPS = 1000
MAX_VECTORS = 512
# candidates at or above the threshold whose answers are read, most similar first
_CANDIDATES = 8
_TIMEOUT_S = 0.25
_WRITE_TIMEOUT_S = _TIMEOUT_S * 4
_EXPIRY = struct.Struct("<d")
# float32's rounding: a text's vector against itself may fall this short of 1
_ROUNDING = 1e-5


def group_of(tenant: str, model: str, encoder: str, generation: Generation,
             max_tokens: int) -> str:
    """The group a prompt's vector is compared within: everything that shapes
    the answer but the last user turn's text."""
    messages = generation["messages"]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    around = [m if i != last_user else {**m, "content": ""} for i, m in enumerate(messages)]
    return answer_key(tenant, model, encoder, generation, max_tokens, around)


def _order(group_key: str) -> str:
    return f"{group_key}:by-expiry"


@dataclass(frozen=True)
class SemanticHit:
    cached: Cached
    similarity: float
    key: str  # the exact cache key of the answer


class SemanticCache:
    """Groups under ``{prefix}:meaning:{group}``, each tenant's indexed in
    ``{prefix}:meaning-index:{tenant}``; answers in the exact cache's entries."""

    def __init__(self, settings: Settings, redis: Redis | None = None) -> None:
        self.settings = settings
        self._redis = redis
        self._owned = redis is None
        self.answers = PromptCache(settings, redis)
        self._problems = RateLimitedLog(log)

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            self._redis = redis_client(self.settings.redis, "cache")
            self.answers = PromptCache(self.settings, self._redis)
        return self._redis

    def _group(self, group: str) -> str:
        return f"{self.settings.kafka.topic_prefix}:meaning:{group}"

    def _index(self, group: str) -> str:
        # a group is ``{tenant}:{digest}`` (group_of) and a digest holds no
        # ':': the tenant is all before the last one, ':' in its id or not
        return f"{self.settings.kafka.topic_prefix}:meaning-index:{group.rsplit(':', 1)[0]}"

    async def nearest(self, group: str, vector: np.ndarray, similarity: float
                      ) -> SemanticHit | None:
        """The most similar kept prompt of ``group`` at least ``similarity``
        alike whose answer is in the exact cache, or None."""
        import numpy as np

        try:
            held = await asyncio.wait_for(self.redis.hgetall(self._group(group)), _TIMEOUT_S)
        except REDIS_ERRORS as exc:
            self._problems.warning("get", "semantic cache: Redis failed (%r); a miss", exc)
            return None
        now, width = time.time(), vector.shape[0] * 4 + _EXPIRY.size
        keys, rows = [], []
        for key, value in held.items():
            if not isinstance(value, bytes) or len(value) != width \
                    or _EXPIRY.unpack_from(value)[0] <= now:
                continue  # another encoder's width, or expired
            keys.append(key.decode() if isinstance(key, bytes) else str(key))
            rows.append(np.frombuffer(value, "<f4", offset=_EXPIRY.size))
        if not rows:
            return None
        sims = np.stack(rows) @ vector
        order = [int(i) for i in np.argsort(-sims, kind="stable")[:_CANDIDATES]
                 if sims[i] >= similarity - _ROUNDING]
        answers = await self.answers.get_many([keys[i] for i in order])
        for i, cached in zip(order, answers, strict=True):  # the most similar whole answer
            if cached is not None:
                return SemanticHit(cached, round(float(sims[i]), 4), keys[i])
        return None

    async def remember(self, group: str, vector: np.ndarray, key: str, ttl_s: int) -> bool:
        """Keep ``vector`` as the prompt whose answer goes under the exact
        cache's ``key``; whether it was kept. The group's oldest beyond
        ``MAX_VECTORS`` and the tenant's oldest groups beyond ``MAX_GROUPS`` go."""
        if ttl_s <= 0:
            return False
        name, index = self._group(group), self._index(group)
        expires = time.time() + ttl_s
        value = _EXPIRY.pack(expires) + vector.astype("<f4").tobytes()
        try:
            # one bound for all of it: past it the vector is not kept, a miss
            async with asyncio.timeout(_WRITE_TIMEOUT_S):
                await self._write(name, index, key, value, expires)
        except REDIS_ERRORS as exc:
            self._problems.warning("put", "semantic cache: Redis failed (%r); not kept", exc)
            return False
        return True

    async def _write(self, name: str, index: str, key: str, value: bytes, expires: float
                     ) -> None:
        order = _order(name)  # the group's entries by expiry, to trim without reading it
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(name, key, value)
            pipe.expireat(name, int(expires) + 1)
            pipe.zadd(order, {key: expires})
            pipe.expireat(order, int(expires) + 1)
            pipe.zadd(index, {name: expires})
            pipe.zremrangebyscore(index, "-inf", time.time())
            pipe.zcard(index)
            pipe.zcard(order)
            pipe.zrange(index, -1, -1, withscores=True)
            *_, groups, size, last = await pipe.execute()
        await outlived_by(self.redis, index, last)
        # over its bounds: the entries, then the tenant's groups, that expire first go
        if keys := await earliest(self.redis, order, int(size) - MAX_VECTORS):
            await self.redis.hdel(name, *keys)
        if members := [text(m) for m in await earliest(self.redis, index,
                                                       int(groups) - MAX_GROUPS)]:
            await self.redis.delete(*members, *map(_order, members))

    async def close(self) -> None:
        if self._owned and self._redis is not None:
            await self._redis.aclose()
            self._redis = None

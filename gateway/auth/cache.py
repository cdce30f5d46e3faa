"""The in-process cache in front of the Redis copy, and the pub/sub channel
``{prefix}:keys:changed`` (a key id, ``tenant:<name>`` or ``*``) that drops its
entries on every replica. :meth:`LocalCache.put` stores nothing if an
invalidation came since its read began; while not subscribed, a hit answers
only when Redis fails (then for ``distrust_retry_s``), so a key revoked as
Redis returns is refused. Every (re)subscription delivers ``*`` (pub/sub keeps
nothing); outages retry with backoff, and three ``ping_s`` unanswered are one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from conveyor.errors import TransientBrokerError
from conveyor.redis_clients import REDIS_ERRORS, Redis, text
from conveyor.settings import Settings
from gateway.auth.redis_copy import EVERYTHING, KeyNames
from gateway.health import TaskHealth
from topics.backoff import Backoff, RateLimitedLog

__all__ = ["LocalCache", "Invalidations"]

log = logging.getLogger(__name__)

V = TypeVar("V")
Listener = Callable[[str], None]
# a Redis that fails, or stops answering the pings: the subscription is made again
_OUTAGE: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TransientBrokerError)


@dataclass
class _Entry(Generic[V]):
    value: V | None
    tag: str
    expires: float


class LocalCache(Generic[V]):
    """``key -> value or None`` with a time limit per entry and drops by tag."""

    def __init__(self, ttl_s: float, negative_ttl_s: float = 1.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic,
                 distrust_retry_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self.distrust_retry_s = distrust_retry_s
        self._read_failed_at: float | None = None
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.generation = 0
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._by_tag: dict[str, set[str]] = {}

    def get(self, key: str) -> tuple[bool, V | None]:
        """(hit, value): a hit with None is a fresh "no such thing"."""
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if self.clock() >= entry.expires:
            self._remove(key)
            return False, None
        return True, entry.value

    def trusted(self, subscribed: bool) -> bool:
        """Whether a hit may answer without reading Redis: always while ``subscribed``,
        else only within ``distrust_retry_s`` of a failed read (see the module's notes)."""
        if subscribed:
            return True
        failed = self._read_failed_at
        return failed is not None and self.clock() - failed < self.distrust_retry_s

    def read_failed(self) -> None:
        """A read of Redis behind this cache failed: hits answer alone for a while."""
        self._read_failed_at = self.clock()

    def read_succeeded(self) -> None:
        self._read_failed_at = None

    async def read_through(self, key: str, read: Callable[[], Awaitable[V | None]],
                           tag: Callable[[V | None], str], subscribed: bool) -> V | None:
        """A trusted hit, else ``read()`` remembered under ``tag(value)``; when the
        read raises :class:`TransientBrokerError` (Redis unreachable) a hit serves."""
        hit, cached = self.get(key)
        if hit and self.trusted(subscribed):
            return cached
        generation = self.generation
        try:
            value = await read()
        except TransientBrokerError:
            if not hit:
                raise
            self.read_failed()
            return cached
        self.read_succeeded()
        self.put(key, value, tag(value), generation)
        return value

    def put(self, key: str, value: V | None, tag: str, generation: int) -> None:
        """Remember ``value`` unless an invalidation came after ``generation`` was read."""
        if generation != self.generation:
            return
        self._remove(key)
        ttl = self.ttl_s if value is not None else self.negative_ttl_s
        self._entries[key] = _Entry(value, tag, self.clock() + ttl)
        if tag:
            self._by_tag.setdefault(tag, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._remove(next(iter(self._entries)))

    def drop(self, tag: str) -> None:
        """Forget every entry of ``tag`` (a key id, ``tenant:<name>``)."""
        self.generation += 1
        for key in self._by_tag.pop(tag, set()):
            self._entries.pop(key, None)

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._by_tag.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.tag:
            keys = self._by_tag.get(entry.tag)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_tag[entry.tag]


class Invalidations:
    """One subscription to the change channel, shared by any number of caches."""

    def __init__(self, settings: Settings, redis: Redis, *, ping_s: float = 5.0) -> None:
        self.settings = settings
        self.redis = redis
        self.channel = KeyNames(settings.kafka.topic_prefix).channel
        self.health = TaskHealth("key-invalidations")
        self.ping_s = ping_s
        self.subscribed = asyncio.Event()
        self._listeners: list[Listener] = []
        self._problems = RateLimitedLog(log)

    @property
    def healthy(self) -> bool:
        """True while subscribed: changes reach this replica at once."""
        return self.health.state == "ok"

    def add(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def deliver(self, message: str) -> None:
        for listener in self._listeners:
            listener(message)

    async def run(self, part: TaskHealth | None = None) -> None:
        """Subscribe and deliver until cancelled; outages are retried, never raised.
        ``part``, when given, is where the state is reported from now on."""
        if part is not None:
            self.health = part
        retry = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                await self._listen(pubsub, retry)
            except _OUTAGE as exc:
                self.subscribed.clear()
                if self.health.set("degraded", f"Redis unreachable: {exc!r}"):
                    log.warning("key invalidations: Redis unreachable (%r); cached keys "
                                "serve until they expire, retrying", exc)
                self._problems.warning("redis", "key invalidations: %r", exc)
                await retry.wait()
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _listen(self, pubsub: Any, retry: Backoff) -> None:
        last_heard = last_ping = time.monotonic()
        while True:
            message = await pubsub.get_message(timeout=min(1.0, self.ping_s))
            now = time.monotonic()
            if message is not None:
                last_heard = now
                kind = message["type"]
                if kind == "subscribe":  # a new subscription: what came before is unknown
                    self.deliver(EVERYTHING)
                    retry.reset()
                    self.subscribed.set()
                    if self.health.set("ok", f"subscribed to {self.channel}"):
                        self._problems.resolved("redis", "key invalidations: subscribed again")
                elif kind == "message":
                    self.deliver(text(message["data"]))
            if now - last_heard > 3 * self.ping_s:
                raise TransientBrokerError(f"no answer from Redis for {now - last_heard:.0f} s")
            if now - last_ping >= self.ping_s:
                last_ping = now
                await pubsub.ping()

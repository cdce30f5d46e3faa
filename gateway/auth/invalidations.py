"""Changes of keys and tenants reaching every replica's cache at once, through pub/sub.

A change is published on ``{prefix}:keys:changed`` (a key id, ``tenant:<name>``
or ``*``) after it is in the topic and in Redis; :meth:`Invalidations.run`
hands each message to every listener. Pub/sub keeps nothing for an absent
subscriber, so every (re)subscription tells the listeners ``*``. Outages are
retried with backoff (health ``degraded``); a PING unanswered for three
``ping_s`` counts as one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from conveyor.errors import TransientBrokerError
from conveyor.redis_clients import REDIS_ERRORS, Redis
from conveyor.settings import Settings
from gateway.auth.redis_copy import EVERYTHING, KeyNames
from gateway.health import TaskHealth
from topics.backoff import Backoff, RateLimitedLog

__all__ = ["Invalidations"]

log = logging.getLogger(__name__)

Listener = Callable[[str], None]
# a Redis that fails, or stops answering the pings: the subscription is made again
_OUTAGE: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TransientBrokerError)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Invalidations:
    """One subscription to the change channel, shared by any number of caches."""

    def __init__(self, settings: Settings, redis: Redis,
                 part: TaskHealth | None = None, *, ping_s: float = 5.0) -> None:
        self.settings = settings
        self.redis = redis
        self.channel = KeyNames(settings.kafka.topic_prefix).channel
        self.health = part or TaskHealth("key-invalidations")
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
                    self.deliver(_text(message["data"]))
            if now - last_heard > 3 * self.ping_s:
                raise TransientBrokerError(f"no answer from Redis for {now - last_heard:.0f} s")
            if now - last_ping >= self.ping_s:
                last_ping = now
                await pubsub.ping()

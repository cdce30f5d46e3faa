"""The gateway's reply path (docs/decisions/0003-reply-partitions-leased.md): a
partition of ``conveyor.replies`` leased in Redis (``{prefix}:reply-lease:{p}``,
renewed; taken again when gone, ``failed`` when another gateway holds it), read
from its end, each reply handed to its request's :class:`ReplyStream`. Kafka
silent for ``stale_after_s`` is ``degraded``, and new requests are refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from conveyor.errors import BrokerError, DeadlineExceeded, RequestError
from conveyor.redis_clients import REDIS_ERRORS, Redis, release, reply_lease_key, text
from conveyor.settings import Settings
from gateway.health import TaskHealth
from schemas.codec import Codec
from schemas.records import Reply, TokenLogprob, Usage
from topics.backoff import Backoff
from topics.catalog import REPLIES
from topics.follow import Follower, follow

__all__ = ["ReplyRouter", "ReplyStream", "ReplyLease", "ReplySource", "Folded", "fold_answer",
           "opening", "reply_error"]

_LATE = "The request did not finish within its deadline."
RETRY_AFTER_S = 1  # what a 503 of the pipeline asks a client to wait

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass
class ReplyStream:
    """The replies of one request, in index order, for one reader, woken by a
    future (docs/decisions/0015-fewer-writes-at-the-gateway.md)."""

    request_id: str
    ready: deque[Reply] = field(default_factory=deque)
    next_index: int = 0
    early: dict[int, Reply] = field(default_factory=dict)
    _waiter: asyncio.Future[None] | None = field(default=None, repr=False)

    async def next(self, deadline: float, within: float | None = None) -> Reply | None:
        """The next reply: one already here at once; else wait for it until
        ``deadline`` (``time.monotonic()``), DeadlineExceeded after it, or for
        ``within`` seconds, None when they passed first."""
        if self.ready:
            return self.ready.popleft()
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(_LATE)
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        # a timer that wakes the waiter, not asyncio.timeout: a chunk a stream a
        # window waits here, and a cancelled scope costs several times a timer
        timer = loop.call_later(left if within is None else min(within, left), _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self.ready:
            return self.ready.popleft()
        if within is not None and time.monotonic() < deadline:
            return None
        raise DeadlineExceeded(_LATE)

    def put(self, reply: Reply) -> None:
        index = reply["index"]
        if index < self.next_index or index in self.early:
            return
        self.early[index] = reply
        while self.next_index in self.early:
            self.ready.append(self.early.pop(self.next_index))
            self.next_index += 1
        waiter = self._waiter
        if self.ready and waiter is not None and not waiter.done():
            waiter.set_result(None)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def reply_error(reply: Reply) -> RequestError:
    """What an ``error`` reply answers the client with."""
    err = reply["error"]
    if err is None:
        return RequestError("The request failed.")
    # a 503 from the pipeline (no worker, overloaded, unreachable) passes soon:
    # the openai client retries after Retry-After
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err["status"] == 503 else None
    return RequestError(err["message"], param=err["param"], code=err["code"],
                        status=err["status"], type=err["type"], headers=headers)


def opening(reply: Reply) -> dict[str, Any]:
    """The first chunk object a reply carries ({} when none)."""
    return dict(json.loads(reply["chunk"].partition("\n")[0] or "{}"))


class ReplySource(Protocol):
    """What a request's replies are read from: a live answer or recorded replies."""

    @property
    def request_id(self) -> str: ...

    async def next(self, within: float | None = None) -> Reply | None: ...


@dataclass
class Folded:
    """A whole answer: its text, why it ended, what it used, and the model its
    chunks name (a fallback's, when one answered; None when none said)."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    model: str | None = None
    # the tokens' log probabilities, where they were asked for
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def fold_answer(source: ReplySource, within: float | None = None,
                      idle: Callable[[], Awaitable[bool]] | None = None) -> Folded | None:
    """Read ``source`` to its final reply. ``idle`` is asked whenever ``within``
    passes without a reply; True gives up (None). An error reply raises."""
    pieces: list[str] = []
    logprobs: list[TokenLogprob] = []
    finish: str | None = None
    model: str | None = None
    while True:
        reply = await source.next(within)
        if reply is None:
            if idle is not None and await idle():
                return None
            continue
        if model is None and reply["chunk"]:
            model = opening(reply).get("model")
        if reply["text"]:
            pieces.append(reply["text"])
        logprobs.extend(reply.get("logprobs") or ())
        if reply["finish_reason"]:
            finish = reply["finish_reason"]
        if reply["kind"] == "final":
            return Folded("".join(pieces), finish, reply["usage"], model, logprobs)


class ReplyLease:
    def __init__(self, settings: Settings, redis: Redis, gateway_id: str,
                 health: TaskHealth | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.gateway_id = gateway_id
        self.partition: int | None = None
        self.health = health or TaskHealth("reply-lease")
        self._ttl_ms = int(settings.gateway.reply_lease_ttl_s * 1000)
        self._renew_every_s = settings.gateway.reply_lease_ttl_s / 3

    def _key(self, partition: int) -> str:
        return reply_lease_key(self.settings.kafka.topic_prefix, partition)

    async def acquire(self) -> int:
        n = self.settings.kafka.reply_partitions
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
        retry = Backoff(max_s=min(self.settings.process.retry_backoff_max_s, self._renew_every_s))
        pause = self._renew_every_s
        while True:
            await asyncio.sleep(pause)
            pause = retry.next_delay()
            try:
                await asyncio.wait_for(self.renew(), timeout=max(1.0, self._renew_every_s))
            except REDIS_ERRORS as exc:
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
        holder_id = text(await self.redis.get(key))
        if self.health.set("failed", f"partition {self.partition} is leased by {holder_id}"):
            log.error("reply partition %d is leased by gateway %s: replies of this "
                      "gateway's requests may go to it", self.partition, holder_id)

    async def release(self) -> None:
        if self.partition is not None:
            with contextlib.suppress(Exception):
                await release(self.redis, self._key(self.partition), self.gateway_id)


class ReplyRouter:
    """Hands each reply on the leased partition to the :class:`ReplyStream` of
    its request, through the shared follower (see the module)."""

    def __init__(self, settings: Settings, codec: Codec, lease: ReplyLease,
                 health: TaskHealth | None = None) -> None:
        self.settings = settings
        self.codec = codec
        self.lease = lease
        self.health = health or TaskHealth("replies")
        self.streams: dict[str, ReplyStream] = {}
        self.follower: Follower | None = None

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
        """Lease a partition and fix its end now: every reply written from here
        on is read, however late :meth:`run` begins."""
        partition = await self.lease.acquire()
        follower = follow(self.settings, REPLIES, partition, "end")
        try:
            await follower.locate()
        except BaseException:  # Kafka refused: a start tried again leases afresh
            await self.lease.release()
            raise
        self.follower = follower

    def kafka_unreachable(self) -> bool:
        """True while the follower has heard nothing from Kafka for its
        ``stale_after_s``."""
        return self.follower is not None and not self.follower.reachable

    async def run(self) -> None:
        """Route replies and keep health in step with the follower, until
        cancelled; an outage ends neither (the follower retries), a failure of
        either ends both, and health shows the task stopped."""
        follower = self.follower
        assert follower is not None, "start() first"
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._route(follower), name="reply-routing")
            tasks.create_task(self._watch(follower), name="reply-sight")

    async def _route(self, follower: Follower) -> None:
        async for batch in follower.events(self.codec):
            for _, reply in batch:
                stream = self.streams.get(reply["envelope"]["request_id"])
                if stream is not None:
                    stream.put(reply)

    async def _watch(self, follower: Follower) -> None:
        async for reachable in follower.reachability():
            if reachable:
                was = self.health.state
                if self.health.set("ok", f"partition {self.partition}") and was == "degraded":
                    log.info("reply follower on partition %d: Kafka answers again",
                             self.partition)
            elif self.health.set("degraded", "no answer from Kafka for "
                                 f"{follower.stale_after_s:.1f} s"):
                log.warning("reply follower on partition %d: no answer from Kafka for %.1f s; "
                            "new requests are refused until it answers", self.partition,
                            follower.stale_after_s)

    async def stop(self) -> None:
        """Give the partition back (the follower's consumer closes with :meth:`run`)."""
        await self.lease.release()

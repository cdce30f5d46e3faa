"""Redis's one door: clients made per role (:data:`ROLES` sets each role's
timeouts) and the boundary where redis-py's errors become Conveyor's, as
topics/clients.py is for Kafka. Nothing else imports ``redis``
(tests/unit/test_layering.py). :data:`REDIS_ERRORS` is what a failing Redis
raises, :data:`REDIS_REFUSALS` what one not up yet raises;
:func:`redis_boundary` raises them as :class:`~conveyor.errors.RedisUnavailable`
(retry) or :class:`~conveyor.errors.RedisRefused` (give up). An answer is read
as :func:`text`; a lease, lock or watch is given back with :func:`release`;
:func:`reply_lease_key` names a reply partition's lease.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.errors import BrokerError, RedisRefused, RedisUnavailable
from conveyor.settings import RedisSettings

__all__ = ["Redis", "RedisRole", "ClientRole", "ROLES", "POOL_SIZE", "redis_client", "REDIS_ERRORS",
           "REDIS_REFUSALS", "RedisError", "RedisConnectionError", "redis_error", "redis_boundary",
           "text", "release", "reply_lease_key"]

RedisRole = Literal["gateway", "claims", "cache", "accounting", "cli"]


@dataclass(frozen=True)
class ClientRole:
    """How long one kind of client waits for Redis, and whether it tries a
    command again on a fresh connection when its pooled one was broken."""

    socket_timeout_s: float  # a command's reply
    connect_timeout_s: float  # a new connection
    retry_broken: bool = False  # one retry, at once, after a ConnectionError


ROLES: Mapping[RedisRole, ClientRole] = {
    # keys, limits, the reply lease, resume tokens, usage reads: a Redis that
    # hangs is an error the caller falls back from, soon. After a restart each
    # pooled connection fails its next command once; the retry answers instead
    # of a 503 while /healthz already says ok.
    "gateway": ClientRole(2.0, 2.0, retry_broken=True),
    # the infer worker's claims, leases and cache writes: a failed claim is
    # decided from the log, so a slow Redis may take longer to give up on
    "claims": ClientRole(5.0, 2.0),
    # preprocess's prompt cache: a lookup is a miss past its own, shorter bound
    # (workers/prompt_cache.py); the socket gives up soon after
    "cache": ClientRole(1.0, 1.0),
    # the usage mirror: off the request path, retried by the next tick
    "accounting": ClientRole(5.0, 5.0),
    # keys, tenants and usage from the shell, and the wait for Redis at start
    "cli": ClientRole(5.0, 5.0),
}

# what a failing Redis raises: its own errors and the socket's (OSError holds
# TimeoutError, which asyncio.wait_for raises too)
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError)
# what a Redis that is not up (yet) raises: a wait for it retries these
REDIS_REFUSALS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError,
                                                   OSError)


_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# connections a client opens at most; past them a command waits for one (as
# long as a new connection may take), where redis-py's own pool of 100 refused
# at once: an infer worker of 512 slots, or a gateway holding as many
# requests, asks that many things of Redis together
POOL_SIZE = 1024


def redis_client(redis: RedisSettings, role: RedisRole) -> Redis:
    """A client of ``redis.url`` with the timeouts of ``role``; the
    caller closes it (``aclose``)."""
    chosen = ROLES[role]
    retry: dict[str, Any] = {"retry": Retry(NoBackoff(), 1),
                             "retry_on_error": [RedisConnectionError]} \
        if chosen.retry_broken else {}
    pool = BlockingConnectionPool.from_url(
        redis.url, max_connections=POOL_SIZE, timeout=chosen.connect_timeout_s,
        socket_timeout=chosen.socket_timeout_s,
        socket_connect_timeout=chosen.connect_timeout_s, **retry)
    client: Redis = Redis.from_pool(pool)
    return client


def redis_error(exc: BaseException, what: str) -> BrokerError:
    """Translate a Redis failure while doing ``what`` into Conveyor's: a command
    Redis refused (a script's error, a key of the wrong type) is
    :class:`RedisRefused`, anything else :class:`RedisUnavailable`."""
    if isinstance(exc, BrokerError):
        return exc
    if isinstance(exc, ResponseError):
        return RedisRefused(f"Redis refused {what}: {exc}")
    return RedisUnavailable(f"Redis unreachable ({what}): {exc!r}")


@contextlib.contextmanager
def redis_boundary(what: str) -> Iterator[None]:
    """Raise Redis's errors inside as Conveyor's (:func:`redis_error`)."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise redis_error(exc, what) from exc


def text(value: Any) -> str:
    """What Redis answered (bytes, or str from a client that decodes) as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


async def release(redis: Redis, key: str, token: str) -> bool:
    """Delete ``key`` if it still holds ``token``, in one step: a lease, lock or
    watch given back by its holder, never one another has taken since."""
    return bool(await redis.eval(_RELEASE, 1, key, token))  # type: ignore[misc]


def reply_lease_key(prefix: str, partition: int | str) -> str:
    """The key that leases reply partition ``partition`` to one gateway
    (gateway/replies.py); with ``""``, what every such key begins with."""
    return f"{prefix}:reply-lease:{partition}"

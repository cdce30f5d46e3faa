"""Redis's door: each role's client has the timeouts chosen for it, and
redis-py's errors become Conveyor's at the boundary."""

from __future__ import annotations

import asyncio
import socket
from typing import get_args

import pytest
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.errors import (
    BrokerError,
    PermanentBrokerError,
    RedisRefused,
    RedisUnavailable,
    TransientBrokerError,
)
from conveyor.redis_clients import (
    REDIS_ERRORS,
    ROLES,
    RedisConnectionError,
    RedisRole,
    redis_boundary,
    redis_client,
    redis_error,
)
from conveyor.settings import load_settings


def dead_url() -> str:
    """A loopback Redis URL nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


def test_every_role_has_its_timeouts() -> None:
    assert set(ROLES) == set(get_args(RedisRole))
    settings = load_settings()
    for role, chosen in ROLES.items():
        client = redis_client(settings.redis, role)
        made = client.connection_pool.connection_kwargs
        assert made["socket_timeout"] == chosen.socket_timeout_s, role
        assert made["socket_connect_timeout"] == chosen.connect_timeout_s, role
        retry = made.get("retry")
        if chosen.retry_broken:
            assert retry is not None and retry.get_retries() == 1, role
            assert made["retry_on_error"] == [RedisConnectionError], role
        else:
            assert retry is None, role
        asyncio.run(client.aclose())


def test_the_gateway_waits_least() -> None:
    gateway = ROLES["gateway"]
    assert gateway.retry_broken
    assert all(gateway.socket_timeout_s <= r.socket_timeout_s
               for name, r in ROLES.items() if name != "cache")


@pytest.mark.parametrize("error", [RedisConnectionError("refused"), RedisTimeoutError("slow"),
                                   ConnectionResetError(), TimeoutError()])
def test_an_unreachable_redis_is_transient(error: BaseException) -> None:
    assert isinstance(error, REDIS_ERRORS)
    mapped = redis_error(error, "reading a key")
    assert isinstance(mapped, RedisUnavailable) and isinstance(mapped, TransientBrokerError)
    assert str(mapped).startswith("Redis unreachable (reading a key)")


def test_a_refused_command_is_permanent() -> None:
    mapped = redis_error(ResponseError("WRONGTYPE"), "storing a key")
    assert isinstance(mapped, RedisRefused) and isinstance(mapped, PermanentBrokerError)
    assert str(mapped) == "Redis refused storing a key: WRONGTYPE"


def test_a_conveyor_error_is_kept() -> None:
    error = TransientBrokerError("no answer from Redis for 15 s")
    assert redis_error(error, "listening") is error


def test_the_boundary_translates_and_keeps_the_cause() -> None:
    with pytest.raises(RedisRefused) as caught, redis_boundary("running a script"):
        raise ResponseError("ERR script")
    assert isinstance(caught.value.__cause__, ResponseError)
    with pytest.raises(ValueError), redis_boundary("anything"):  # not Redis's: as it is
        raise ValueError("a bug")


def test_a_redis_that_is_not_there_is_unavailable() -> None:
    async def ping() -> None:
        client = redis_client(load_settings(redis_url=dead_url()).redis, "cli")
        try:
            with redis_boundary("pinging"):
                await client.ping()
        finally:
            await client.aclose()

    with pytest.raises(RedisUnavailable) as caught:
        asyncio.run(ping())
    assert isinstance(caught.value, BrokerError)
    assert isinstance(caught.value.__cause__, REDIS_ERRORS)

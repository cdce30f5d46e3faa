"""Fixtures the gateway's tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def redis() -> AsyncIterator[aioredis.Redis]:
    """A client of the suite's real Redis (infra/redis.sh)."""
    client = aioredis.from_url("redis://127.0.0.1:6379/0")
    try:
        yield client
    finally:
        await client.aclose()

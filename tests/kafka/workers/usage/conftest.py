"""A topic prefix of each test's own, and a Redis client whose keys under it
are deleted after the test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from conveyor.settings import Settings, load_settings
from tests.support.services import prefix_redis


@pytest.fixture
def settings(services: None) -> Settings:
    return load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def redis(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    async with prefix_redis(settings) as client:
        yield client

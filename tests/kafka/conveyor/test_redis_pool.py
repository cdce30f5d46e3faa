"""Redis's door against the real Redis: a client serves more commands at once
than redis-py's own pool of 100 held."""

from __future__ import annotations

import asyncio
import uuid

from conveyor.redis_clients import redis_client
from conveyor.settings import load_settings


async def test_a_client_serves_three_hundred_commands_at_once(services: None) -> None:
    """Each BLPOP holds its connection a quarter of a second: 300 at once need
    300 connections (redis-py's pool refused the 101st with "Too many
    connections", which every caller takes for a Redis outage)."""
    client = redis_client(load_settings().redis, "claims")
    key = f"test-pool-{uuid.uuid4().hex}"
    try:
        answers = await asyncio.gather(*(client.blpop([key], timeout=0.25)
                                         for _ in range(300)))
    finally:
        await client.aclose()
    assert answers == [None] * 300

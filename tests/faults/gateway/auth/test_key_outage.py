"""Redis stops (a Redis of the test's own): cached keys and tenants keep
working until their entries expire, an uncached one is a transient error
(503, never 401), and the invalidation subscriber reports the outage, comes
back by itself and clears the cache, since it may have missed messages."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.errors import TransientBrokerError
from gateway.auth.types import Limits
from gateway.health import TaskHealth
from tests.support.key_backends import backends, key_settings, wait_until
from tests.support.services import OwnRedis
from topics.envelope import now_ms

pytestmark = pytest.mark.usefixtures("services")


async def test_cached_keys_outlive_a_redis_outage(own_redis: OwnRedis) -> None:
    settings = key_settings(own_redis.url, key_cache_s=30)
    async with backends(settings) as b:
        admin = b.keys()
        cached, cached_secret = await admin.create("acme", "cached", Limits(rpm=2))
        other, other_secret = await admin.create("acme", "other", Limits())
        await b.tenants().set("acme", Limits(rpm=10))
        part = TaskHealth("keys")
        gateway = b.gateway_keys(subscribe=False)
        b.tasks.append(asyncio.create_task(gateway.invalidations.run(part)))
        await asyncio.wait_for(gateway.invalidations.subscribed.wait(), 5)
        assert part.state == "ok" and gateway.healthy
        tenants = b.tenants(subscribe=False)
        assert (await gateway.lookup(cached_secret) or other).id == cached.id
        assert (await tenants.get("acme")).limits.rpm == 10

        own_redis.stop()
        found = await gateway.lookup(cached_secret)
        assert found is not None and found.id == cached.id and found.usable(now_ms())
        assert (await tenants.get("acme")).limits.rpm == 10
        with pytest.raises(TransientBrokerError):
            await gateway.lookup(other_secret)
        with pytest.raises(TransientBrokerError):
            await gateway.lookup("cvy-" + "Q" * 40)  # unknown is not known to be unknown
        with pytest.raises(TransientBrokerError):
            await tenants.get("globex")
        await gateway.touch(cached)  # last use is best effort: no error
        await wait_until(lambda: part.state == "degraded", 10, "the outage is reported")
        assert not gateway.healthy and "Redis" in part.detail

        own_redis.start()
        await wait_until(lambda: part.state == "ok", 10, "subscribed again")
        assert len(gateway.cache) == 0  # messages may have been missed: start afresh
        assert (await gateway.lookup(other_secret) or cached).id == other.id


async def test_a_cached_key_stops_working_when_its_entry_expires(
        own_redis: OwnRedis) -> None:
    settings = key_settings(own_redis.url, key_cache_s=0.3)
    async with backends(settings) as b:
        record, secret = await b.keys().create("acme", "ci", Limits())
        gateway = b.gateway_keys(subscribe=False)
        assert (await gateway.lookup(secret) or None) is not None
        own_redis.stop()
        assert (await gateway.lookup(secret) or None) is not None
        await asyncio.sleep(0.35)
        with pytest.raises(TransientBrokerError):
            await gateway.lookup(secret)

"""Tenant policies against the real Kafka and Redis: a tenant never set has no
limits; setting changes only what is given (0 clears); every replica's cache
follows through pub/sub; each change is in the topic and the audit."""

from __future__ import annotations

import asyncio

import pytest

from gateway.auth.types import Limits, TenantPolicy
from schemas.codec import default_codec
from tests.support.key_backends import backends, key_settings, read_topic, wait_until

pytestmark = pytest.mark.usefixtures("services")


async def test_set_get_list_and_what_a_change_keeps() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.tenants()
        assert await store.get("acme") == TenantPolicy("acme")
        assert await store.list() == []
        first = await store.set("acme", Limits(rpm=60, tpm=1000), daily_tokens=5000,
                                monthly_tokens=90_000, actor="alice")
        assert first == TenantPolicy("acme", Limits(rpm=60, tpm=1000), 5000, 90_000, 1)
        assert await store.get("acme") == first  # the writer's cache was dropped
        second = await store.set("acme", Limits(rpm=0, concurrency=8), daily_tokens=0)
        assert second == TenantPolicy("acme", Limits(tpm=1000, concurrency=8), None,
                                      90_000, 2)
        await store.set("globex", Limits())
        assert [t.name for t in await store.list()] == ["acme", "globex"]
        assert await b.tenants().get("acme") == second
        with pytest.raises(ValueError):
            await store.set("acme", Limits(tpm=-5))
        with pytest.raises(ValueError):
            await store.set("", Limits(rpm=1))

        codec = default_codec()
        records = [(k, codec.decode(v, "TenantPolicy"))
                   for k, v in await read_topic(settings, "keys")]
        assert [(k, r["version"], r["rpm"]) for k, r in records] == [
            (b"tenant:acme", 1, 60), (b"tenant:acme", 2, None), (b"tenant:globex", 1, None)]
        audit = [codec.decode(v, "AuditEvent") for _, v in await read_topic(settings, "audit")]
        assert [(a["action"], a["tenant"]) for a in audit] == [
            ("tenant.set", "acme"), ("tenant.set", "acme"), ("tenant.set", "globex")]
        assert audit[0]["actor"] == "alice" and audit[0]["detail"]["daily_tokens"] == "5000"


async def test_a_change_reaches_another_replica_at_once() -> None:
    settings = key_settings(key_cache_s=60)
    async with backends(settings) as b:
        admin = b.tenants()
        replica = b.tenants(subscribe=True)
        await asyncio.wait_for(replica.invalidations.subscribed.wait(), 5)
        assert await replica.get("acme") == TenantPolicy("acme")  # cached: never set
        await admin.set("acme", Limits(rpm=5))
        await wait_until(lambda: not replica.cache.get("acme")[0], 1.0, "entry dropped")
        assert (await replica.get("acme")).limits.rpm == 5

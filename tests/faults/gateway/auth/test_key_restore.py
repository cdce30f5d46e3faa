"""Redis loses its data (FLUSHALL on a Redis of the test's own): no key is lost,
no revoked key comes back, tenants' policies return, one replica restores."""

from __future__ import annotations

import asyncio

import pytest

from gateway.auth.keys import KeyNotFound
from gateway.auth.keys_topic import KeysTopic, Restorer
from gateway.auth.redis_copy import KeyNames, RedisCopy
from gateway.auth.types import Limits, TenantPolicy
from tests.support.key_backends import backends, key_settings
from tests.support.services import OwnRedis
from topics.envelope import now_ms

pytestmark = pytest.mark.usefixtures("services")


async def test_a_flushed_redis_loses_no_key_and_revives_no_revoked_one(
        own_redis: OwnRedis) -> None:
    settings = key_settings(own_redis.url)
    async with backends(settings) as b:
        admin = b.keys()
        live, live_secret = await admin.create("acme", "live", Limits(rpm=3))
        live = await admin.update(live.id, limits=Limits(rpm=4), name="live-2")
        dead, dead_secret = await admin.create("acme", "dead", Limits())
        await admin.revoke(dead.id)
        await b.tenants().set("acme", Limits(tpm=500), daily_tokens=10_000)

        own_redis.flush()
        names = KeyNames(settings.kafka.topic_prefix)
        redis = b.redis()
        assert await redis.exists(names.restored) == 0

        gateway = b.gateway_keys(subscribe=False)  # a fresh replica: nothing cached
        found = await gateway.lookup(live_secret)
        assert found is not None and found.usable(now_ms())
        assert (found.version, found.name, found.limits.rpm) == (2, "live-2", 4)
        refused = await gateway.lookup(dead_secret)
        assert refused is not None and refused.revoked_ms and not refused.usable(now_ms())
        assert await redis.exists(names.restored) == 1
        assert await b.tenants().get("acme") == TenantPolicy(
            "acme", Limits(tpm=500), daily_tokens=10_000, version=1)
        assert {k.id for k in await gateway.list("acme")} == {live.id, dead.id}

        # once restored, an unknown key is just unknown: no second restore
        assert not await gateway.restorer.ensure()
        assert await gateway.lookup("cvy-" + "Z" * 40) is None


async def test_listing_and_changing_after_a_flush_restore_first(own_redis: OwnRedis) -> None:
    settings = key_settings(own_redis.url)
    async with backends(settings) as b:
        admin = b.keys()
        record, _ = await admin.create("acme", "ci", Limits(rpm=3))
        own_redis.flush()
        updated = await b.keys().update(record.id, limits=Limits(tpm=8))
        assert updated.version == 2 and updated.limits == Limits(rpm=3, tpm=8)
        own_redis.flush()
        assert [k.limits for k in await b.keys().list()] == [Limits(rpm=3, tpm=8)]
        own_redis.flush()
        assert await b.tenants().list() == []  # restored: there simply are none
        await b.tenants().set("globex", Limits(rpm=1))
        own_redis.flush()
        assert [t.name for t in await b.tenants().list()] == ["globex"]


async def test_one_replica_restores_while_the_others_wait(own_redis: OwnRedis) -> None:
    settings = key_settings(own_redis.url)
    async with backends(settings) as b:
        admin = b.keys()
        made = [await admin.create("acme", f"k{i}", Limits()) for i in range(3)]
        own_redis.flush()
        restorers = [Restorer(RedisCopy(settings, b.redis()), KeysTopic(settings))
                     for _ in range(4)]
        did = await asyncio.gather(*(r.ensure() for r in restorers))
        assert sorted(did) == [False, False, False, True]
        gateway = b.gateway_keys(subscribe=False)
        for record, secret in made:
            assert (await gateway.lookup(secret) or record).id == record.id
        lock = KeyNames(settings.kafka.topic_prefix).restore_lock
        assert await b.redis().exists(lock) == 0  # released


async def test_an_explicit_restore_runs_even_when_marked(own_redis: OwnRedis) -> None:
    settings = key_settings(own_redis.url)
    async with backends(settings) as b:
        admin = b.keys()
        record, secret = await admin.create("acme", "ci", Limits())
        await b.tenants().set("acme", Limits(rpm=9))
        assert await admin.restore() == (1, 1)
        # a key Redis lost alone (not all of Redis) comes back with an explicit restore
        redis = b.redis()
        names = KeyNames(settings.kafka.topic_prefix)
        await redis.delete(names.key(record.id), names.keyhash(record.hash))
        with pytest.raises(KeyNotFound):  # marked restored: no automatic restore
            await admin.update(record.id, name="again")
        assert await admin.restore() == (1, 1)
        assert (await b.gateway_keys(subscribe=False).lookup(secret) or record).id == record.id

"""The key store against the real Kafka and Redis: create, look up, list,
update, revoke; only the keyed hash is ever kept; changes reach another
replica's cache through pub/sub; expiry; last use; the audit trail."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from pydantic import SecretStr

from conveyor.errors import ConveyorError
from gateway.auth.keys import KeyNotFound, KeyRevoked
from gateway.auth.redis_copy import KeyNames
from gateway.auth.secrets import AuthSecretMissing, hash_secret
from gateway.auth.types import KeyRecord, Limits
from schemas.codec import default_codec
from tests.support.key_backends import backends, key_settings, read_topic, wait_until
from topics.envelope import now_ms

pytestmark = pytest.mark.usefixtures("services")


async def test_create_lookup_list_update_revoke() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.keys()
        record, secret = await store.create("acme", "ci", Limits(rpm=60, tpm=1000),
                                            models=("smollm2",), actor="alice")
        assert re.fullmatch(r"key_[0-9a-f]{16}", record.id)
        assert re.fullmatch(r"cvy-[A-Za-z0-9_-]{40}", secret)
        assert record.hash == hash_secret(settings.auth, secret) and record.version == 1
        assert (record.tenant, record.name, record.models) == ("acme", "ci", ("smollm2",))

        found = await b.gateway_keys(subscribe=False).lookup(secret)
        assert found is not None and found.id == record.id and found.usable(now_ms())
        assert found.limits == Limits(rpm=60, tpm=1000)
        assert await store.lookup(secret + "x") is None
        assert await store.lookup("not-a-key") is None
        assert await store.copy.get_key(record.id) == found

        other, _ = await store.create("globex", "batch", Limits())
        assert [k.id for k in await store.list("acme")] == [record.id]
        assert {k.id for k in await store.list()} == {record.id, other.id}

        # each limit given replaces, 0 clears, the others stay
        updated = await store.update(record.id, limits=Limits(rpm=0, concurrency=4),
                                     name="ci-2")
        assert updated.limits == Limits(rpm=None, tpm=1000, concurrency=4)
        assert (updated.name, updated.models, updated.version) == ("ci-2", ("smollm2",), 2)
        updated = await store.update(record.id, models=())
        assert updated.models == () and updated.limits.tpm == 1000 and updated.version == 3
        assert (await store.lookup(secret)) == updated  # the writer's own cache follows

        revoked = await store.revoke(record.id)
        assert revoked.revoked_ms and revoked.version == 4
        assert not revoked.usable(now_ms())
        again = await store.lookup(secret)
        assert again is not None and again.revoked_ms and not again.usable(now_ms())
        assert await store.revoke(record.id) == revoked  # twice changes nothing
        with pytest.raises(KeyRevoked):
            await store.update(record.id, name="back")
        with pytest.raises(KeyNotFound):
            await store.revoke("key_0000000000000000")
        with pytest.raises(KeyNotFound):
            await store.update("key_0000000000000000", name="x")
        assert await store.copy.get_key("key_0000000000000000") is None
        with pytest.raises(ValueError):
            await store.update(other.id, limits=Limits(rpm=-1))


async def test_only_the_keyed_hash_is_kept_anywhere() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.keys()
        record, secret = await store.create("acme", "ci", Limits(rpm=5))
        await store.update(record.id, limits=Limits(tpm=9))
        await store.revoke(record.id)
        await store.touch(record)
        redis = b.redis()
        kept: list[Any] = []
        async for name in redis.scan_iter(match=f"{settings.kafka.topic_prefix}:*", count=1000):
            kept.append(name)
            kind = await redis.type(name)
            if kind == b"hash":
                for k, v in (await redis.hgetall(name)).items():
                    kept += [k, v]
            elif kind == b"set":
                kept += list(await redis.smembers(name))
            elif kind == b"string":
                kept.append(await redis.get(name) or b"")
        redis_bytes = b"\n".join(kept)
        topic_bytes = b"\n".join(k + v for k, v in await read_topic(settings, "keys"))
        audit_bytes = b"\n".join(k + v for k, v in await read_topic(settings, "audit"))
        for where in (redis_bytes, topic_bytes, audit_bytes):
            assert secret.encode() not in where
            assert secret[4:].encode() not in where
        assert record.hash.encode() in redis_bytes and record.hash.encode() in topic_bytes
        names = KeyNames(settings.kafka.topic_prefix)
        assert await redis.get(names.keyhash(record.hash)) == record.id.encode()
        # the hash depends on the server secret: another secret, another hash
        other = key_settings(auth_secret=SecretStr("another-server-secret"))
        assert hash_secret(other.auth, secret) != record.hash


async def test_every_change_is_in_the_topic_and_the_audit() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.keys()
        record, _ = await store.create("acme", "ci", Limits(rpm=5), actor="alice")
        await store.update(record.id, limits=Limits(rpm=7), actor="bob")
        await store.revoke(record.id, actor="carol")
        codec = default_codec()
        events = [codec.decode(v, "ApiKey") for k, v in await read_topic(settings, "keys")
                  if k == record.id.encode()]
        assert [(e["version"], e["rpm"], bool(e["revoked_ms"])) for e in events] == [
            (1, 5, False), (2, 7, False), (3, 7, True)]
        audit = [codec.decode(v, "AuditEvent") for _, v in await read_topic(settings, "audit")]
        assert [(a["action"], a["key_id"], a["tenant"], a["actor"]) for a in audit] == [
            ("key.created", record.id, "acme", "alice"),
            ("key.updated", record.id, "acme", "bob"),
            ("key.revoked", record.id, "acme", "carol")]
        assert audit[1]["detail"]["rpm"] == "7"


async def test_a_revocation_reaches_another_replica_within_a_second() -> None:
    settings = key_settings(key_cache_s=60)
    async with backends(settings) as b:
        admin = b.keys()
        record, secret = await admin.create("acme", "ci", Limits())
        replica = b.gateway_keys()
        await asyncio.wait_for(replica.invalidations.subscribed.wait(), 5)
        assert replica.healthy
        first = await replica.lookup(secret)
        assert first is not None and first.usable(now_ms())
        assert replica.cache.get(record.hash)[0]  # cached, trusted for a minute

        await admin.revoke(record.id)
        took = await wait_until(lambda: not replica.cache.get(record.hash)[0], 1.0,
                                "the replica's cache entry dropped")
        seen = await replica.lookup(secret)
        assert seen is not None and seen.revoked_ms and not seen.usable(now_ms())
        assert took < 1.0
        # an update reaches it the same way
        live, live_secret = await admin.create("acme", "ci2", Limits(rpm=1))
        await replica.lookup(live_secret)
        await admin.update(live.id, limits=Limits(rpm=2))
        await wait_until(lambda: not replica.cache.get(live.hash)[0], 1.0, "update dropped")
        looked = await replica.lookup(live_secret)
        assert looked is not None and looked.limits.rpm == 2


async def test_a_replica_not_subscribed_reads_redis_before_its_cache() -> None:
    """Between Redis answering again and the subscription catching up, a revocation
    is not announced to this replica: its cached entries must not answer alone."""
    settings = key_settings(key_cache_s=30)
    async with backends(settings) as b:
        record, secret = await b.keys().create("acme", "ci", Limits())
        await b.tenants().set("acme", Limits(rpm=10))
        gateway = b.gateway_keys(subscribe=False)  # no subscription: hears of nothing
        tenants = b.tenants(subscribe=False)
        assert (await gateway.lookup(secret) or record).usable(now_ms())
        assert (await tenants.get("acme")).limits.rpm == 10
        await b.keys().revoke(record.id)
        await b.tenants().set("acme", Limits(rpm=20))
        found = await gateway.lookup(secret)
        assert found is not None and not found.usable(now_ms())
        assert (await tenants.get("acme")).limits.rpm == 20


async def test_an_expired_key_is_known_but_not_usable() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.keys()
        record, secret = await store.create("acme", "short", Limits(), expires_in_s=0.3)
        assert record.expires_ms - record.created_ms == 300
        found = await store.lookup(secret)
        assert found is not None and found.usable(now_ms())
        await asyncio.sleep(0.35)
        found = await store.lookup(secret)
        assert found is not None and found.expires_ms and not found.usable(now_ms())
        with pytest.raises(ValueError):
            await store.create("acme", "never-valid", Limits(), expires_in_s=0)


async def test_unknown_keys_are_remembered_briefly() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.gateway_keys(subscribe=False, negative_cache_s=0.2)
        bogus = "cvy-" + "A" * 40
        assert await store.lookup(bogus) is None
        key_hash = hash_secret(settings.auth, bogus)
        assert store.cache.get(key_hash) == (True, None)
        await asyncio.sleep(0.25)
        assert store.cache.get(key_hash) == (False, None)


async def test_touch_records_last_use_at_most_once_a_minute() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.keys()
        record, _ = await store.create("acme", "ci", Limits())
        assert (await store.list())[0].last_used_ms == 0
        before = now_ms()
        await store.touch(record)
        first = (await store.list())[0].last_used_ms
        assert before <= first <= now_ms()
        await asyncio.sleep(0.01)
        await store.touch(record)  # within the minute: not written again
        assert (await store.copy.get_key(record.id) or record).last_used_ms == first
        other_process = b.keys(touch_every_s=0.0)
        await asyncio.sleep(0.01)
        await other_process.touch(record)
        assert (await store.copy.get_key(record.id) or record).last_used_ms > first
        # last use stays out of the record: the topic has no such field
        assert "last_used_ms" not in default_codec().decode(
            (await read_topic(settings, "keys"))[-1][1], "ApiKey")


async def test_a_store_refuses_to_hash_without_a_server_secret() -> None:
    settings = key_settings(auth_secret=SecretStr(""))
    async with backends(settings) as b:
        store = b.keys()
        with pytest.raises(AuthSecretMissing, match="CONVEYOR_AUTH_SECRET"):
            await store.create("acme", "ci", Limits())
        with pytest.raises(AuthSecretMissing):
            await store.lookup("cvy-" + "B" * 40)
        assert await store.list() == []  # nothing was written


async def test_a_store_without_a_producer_reads_but_does_not_write() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        record, secret = await b.keys().create("acme", "ci", Limits())
        gateway = b.gateway_keys(subscribe=False)
        assert (await gateway.lookup(secret) or record).id == record.id
        with pytest.raises(ConveyorError, match="producer"):
            await gateway.revoke(record.id)
        assert not (await gateway.copy.get_key(record.id) or record).revoked_ms


async def test_redis_never_takes_an_older_version() -> None:
    settings = key_settings()
    async with backends(settings) as b:
        store = b.keys()
        record, _ = await store.create("acme", "ci", Limits(rpm=1))
        newer = await store.update(record.id, limits=Limits(rpm=2))
        assert not await store.copy.put_key(record)  # version 1 after version 2
        assert not await store.copy.put_key(newer)  # the same version again
        assert (await store.copy.get_key(record.id) or record).limits.rpm == 2
        ahead = KeyRecord(**{**newer.__dict__, "version": 9, "name": "nine"})
        assert await store.copy.put_key(ahead)
        assert (await store.copy.get_key(record.id) or record).name == "nine"


def test_key_ids_and_secrets_are_fresh_each_time() -> None:
    from gateway.auth.secrets import new_key_id, new_secret

    assert len({new_secret() for _ in range(100)}) == 100
    assert len({new_key_id() for _ in range(100)}) == 100

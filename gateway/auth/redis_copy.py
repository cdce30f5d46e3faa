"""The Redis copy of the ``keys`` topic that keys and tenants are looked up in
(layout: docs/decisions/0026-keys-and-limits-in-redis.md). Every write is a Lua
script refusing a version not newer than the stored one; Redis's errors stop
here as :class:`~conveyor.errors.RedisUnavailable` or ``RedisRefused``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from conveyor.redis_clients import Redis, redis_boundary, text
from conveyor.settings import Settings
from gateway.auth.types import KeyRecord, Limits, TenantPolicy

__all__ = ["KeyNames", "RedisCopy", "key_fields", "key_from_fields",
           "tenant_fields", "tenant_from_fields", "TENANT_PREFIX", "EVERYTHING"]

T = TypeVar("T")

# the record key (and pub/sub message) of a tenant's policy: tenant:<name>
TENANT_PREFIX = "tenant:"
# the pub/sub message that drops every cached entry
EVERYTHING = "*"

_PUT_KEY = """
local cur = redis.call('HGET', KEYS[1], 'version')
if cur and tonumber(cur) >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
return 1
"""
_PUT_TENANT = """
local cur = redis.call('HGET', KEYS[1], 'version')
if cur and tonumber(cur) >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
# KEYS[1] the index of a hash, KEYS[2] the restore marker; ARGV[1] the key hash prefix
_FIND = """
local marker = redis.call('EXISTS', KEYS[2])
local id = redis.call('GET', KEYS[1])
if not id then return {marker} end
return {marker, redis.call('HGETALL', ARGV[1] .. id)}
"""
# KEYS[1] a tenant hash, KEYS[2] the restore marker
_GET_TENANT = """
return {redis.call('EXISTS', KEYS[2]), redis.call('HGETALL', KEYS[1])}
"""
_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cur = tonumber(redis.call('HGET', KEYS[1], 'last_used_ms') or '0') or 0
if tonumber(ARGV[1]) > cur then redis.call('HSET', KEYS[1], 'last_used_ms', ARGV[1]) end
return 1
"""


@dataclass(frozen=True)
class KeyNames:
    """The Redis key names of one prefix (see the module's table)."""

    prefix: str

    def key(self, key_id: str) -> str:
        return f"{self.prefix}:key:{key_id}"

    def keyhash(self, key_hash: str) -> str:
        return f"{self.prefix}:keyhash:{key_hash}"

    def tenant_keys(self, tenant: str) -> str:
        return f"{self.prefix}:keys:tenant:{tenant}"

    @property
    def all_keys(self) -> str:
        return f"{self.prefix}:keys:all"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}:tenant:{name}"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    @property
    def restored(self) -> str:
        return f"{self.prefix}:keys:restored"

    @property
    def restore_lock(self) -> str:
        return f"{self.prefix}:keys:restore-lock"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:keys:changed"


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text else None


def _limits_fields(limits: Limits) -> dict[str, str]:
    return {"rpm": _opt(limits.rpm), "tpm": _opt(limits.tpm),
            "concurrency": _opt(limits.concurrency)}


def _limits_from(f: Mapping[str, str]) -> Limits:
    return Limits(rpm=_int_or_none(f.get("rpm")), tpm=_int_or_none(f.get("tpm")),
                  concurrency=_int_or_none(f.get("concurrency")))


def key_fields(record: KeyRecord) -> dict[str, str]:
    """A key's Redis hash (everything but ``last_used_ms``, which only touches write)."""
    return {"id": record.id, "tenant": record.tenant, "name": record.name,
            "hash": record.hash, **_limits_fields(record.limits),
            "models": json.dumps(list(record.models)), "created_ms": str(record.created_ms),
            "expires_ms": str(record.expires_ms), "revoked_ms": str(record.revoked_ms),
            "version": str(record.version)}


def _as_text_map(raw: Mapping[Any, Any] | Sequence[Any]) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {text(k): text(v) for k, v in raw.items()}
    items = list(raw)
    return {text(items[i]): text(items[i + 1]) for i in range(0, len(items) - 1, 2)}


def key_from_fields(raw: Mapping[Any, Any] | Sequence[Any]) -> KeyRecord | None:
    """A key from its Redis hash (a mapping or HGETALL's flat list); None when empty."""
    f = _as_text_map(raw)
    if not f.get("id"):
        return None
    return KeyRecord(id=f["id"], tenant=f.get("tenant", ""), name=f.get("name", ""),
                     hash=f.get("hash", ""), limits=_limits_from(f),
                     models=tuple(json.loads(f.get("models") or "[]")),
                     created_ms=int(f.get("created_ms") or 0),
                     expires_ms=int(f.get("expires_ms") or 0),
                     revoked_ms=int(f.get("revoked_ms") or 0),
                     last_used_ms=int(f.get("last_used_ms") or 0),
                     version=int(f.get("version") or 0))


def tenant_fields(policy: TenantPolicy) -> dict[str, str]:
    return {"name": policy.name, **_limits_fields(policy.limits),
            "daily_tokens": _opt(policy.daily_tokens),
            "monthly_tokens": _opt(policy.monthly_tokens), "version": str(policy.version)}


def tenant_from_fields(raw: Mapping[Any, Any] | Sequence[Any]) -> TenantPolicy | None:
    f = _as_text_map(raw)
    if not f.get("name"):
        return None
    return TenantPolicy(name=f["name"], limits=_limits_from(f),
                        daily_tokens=_int_or_none(f.get("daily_tokens")),
                        monthly_tokens=_int_or_none(f.get("monthly_tokens")),
                        version=int(f.get("version") or 0))


def _flat(fields: dict[str, str]) -> list[str]:
    return [x for pair in fields.items() for x in pair]


class RedisCopy:
    """Reads and version-guarded writes of the Redis copy of one prefix."""

    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.redis = redis
        self.names = KeyNames(settings.kafka.topic_prefix)
        self._put_key = redis.register_script(_PUT_KEY)
        self._put_tenant = redis.register_script(_PUT_TENANT)
        self._find = redis.register_script(_FIND)
        self._get_tenant = redis.register_script(_GET_TENANT)
        self._touch = redis.register_script(_TOUCH)

    async def put_key(self, record: KeyRecord) -> bool:
        """Store a key unless Redis has this version or a newer one; True if stored."""
        n = self.names
        with redis_boundary("storing a key"):
            done = await self._put_key(
                keys=[n.key(record.id), n.keyhash(record.hash), n.tenant_keys(record.tenant),
                      n.all_keys],
                args=[record.id, record.version, *_flat(key_fields(record))])
        return bool(done)

    async def put_tenant(self, policy: TenantPolicy) -> bool:
        n = self.names
        with redis_boundary("storing a tenant policy"):
            done = await self._put_tenant(
                keys=[n.tenant(policy.name), n.tenants],
                args=[policy.name, policy.version, *_flat(tenant_fields(policy))])
        return bool(done)

    async def find(self, key_hash: str) -> tuple[KeyRecord | None, bool]:
        """(the key with this hash or None, whether Redis holds the whole topic)."""
        n = self.names
        with redis_boundary("looking a key up"):
            reply = await self._find(keys=[n.keyhash(key_hash), n.restored],
                                     args=[n.key("")])
        restored = bool(reply[0])
        return (key_from_fields(reply[1]) if len(reply) > 1 else None), restored

    async def get_key(self, key_id: str) -> KeyRecord | None:
        with redis_boundary("reading a key"):
            raw = await self.redis.hgetall(self.names.key(key_id))  # type: ignore[misc]
        return key_from_fields(raw)

    async def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        n = self.names
        return await self._listed("listing keys", n.all_keys if tenant is None
                                  else n.tenant_keys(tenant), n.key, key_from_fields)

    async def get_tenant(self, name: str) -> tuple[TenantPolicy | None, bool]:
        """(the tenant's stored policy or None, whether Redis holds the whole topic)."""
        n = self.names
        with redis_boundary("reading a tenant policy"):
            reply = await self._get_tenant(keys=[n.tenant(name), n.restored])
        return tenant_from_fields(reply[1]), bool(reply[0])

    async def list_tenants(self) -> list[TenantPolicy]:
        n = self.names
        return await self._listed("listing tenants", n.tenants, n.tenant, tenant_from_fields)

    async def _listed(self, what: str, members: str, hash_of: Callable[[str], str],
                      parse: Callable[[list[Any]], T | None]) -> list[T]:
        """The records whose ids the set ``members`` holds, by id."""
        with redis_boundary(what):
            ids = await self.redis.smembers(members)  # type: ignore[misc]
            pipe = self.redis.pipeline(transaction=False)
            for member in sorted(text(i) for i in ids):
                pipe.hgetall(hash_of(member))
            raws = await pipe.execute()
        return [r for r in map(parse, raws) if r is not None]

    async def touch(self, key_id: str, ms: int) -> bool:
        """Set ``last_used_ms`` (never backwards, never on a key Redis lost)."""
        with redis_boundary("recording a key's use"):
            return bool(await self._touch(keys=[self.names.key(key_id)], args=[ms]))

    async def is_restored(self) -> bool:
        with redis_boundary("reading the restore marker"):
            return bool(await self.redis.exists(self.names.restored))

    async def publish(self, message: str) -> None:
        """Tell every replica's cache that ``message`` (an id, tenant:<name>, *) changed."""
        with redis_boundary("publishing a change"):
            await self.redis.publish(self.names.channel, message)

"""The Redis copy of the ``keys`` topic that keys and tenants are looked up in
(layout: docs/decisions/0026-keys-and-limits-in-redis.md). Every write is a Lua
script refusing a version not newer than the stored one; Redis's errors stop
here as :class:`~conveyor.errors.RedisUnavailable` or ``RedisRefused``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast, get_origin, get_type_hints

from conveyor.redis_clients import Redis, redis_boundary, text
from conveyor.settings import Settings
from gateway.auth.types import KeyRecord, TenantPolicy
from schemas.records import ApiKey
from schemas.records import TenantPolicy as TenantPolicyEvent

__all__ = ["KeyNames", "RedisCopy", "key_from_fields", "tenant_from_fields", "TENANT_PREFIX",
           "EVERYTHING"]

T = TypeVar("T")
E = TypeVar("E", ApiKey, TenantPolicyEvent)

# the record key (and pub/sub message) of a tenant's policy: tenant:<name>
TENANT_PREFIX = "tenant:"
# the pub/sub message that drops every cached entry
EVERYTHING = "*"
# the fields of what a hash holds, by their types
_HINTS: dict[type[Any], dict[str, Any]] = {
    of: get_type_hints(of) for of in (ApiKey, TenantPolicyEvent)}

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


def _fields(event: Mapping[str, Any]) -> dict[str, str]:
    """A record's Redis hash: its event's fields as text ("" for no limit, a list as
    JSON); a key's has ``last_used_ms`` besides, which only touches write."""
    return {k: "" if v is None else json.dumps(v) if isinstance(v, list) else str(v)
            for k, v in event.items()}


def _event(of: type[E], raw: Mapping[Any, Any] | Sequence[Any]) -> tuple[E, dict[str, str]]:
    """The event of type ``of`` a Redis hash (a mapping or HGETALL's flat list)
    holds, what it lacks empty, 0 or no limit; and the hash as text."""
    if isinstance(raw, Mapping):
        fields = {text(k): text(v) for k, v in raw.items()}
    else:
        items = list(raw)
        fields = {text(items[i]): text(items[i + 1]) for i in range(0, len(items) - 1, 2)}
    event: dict[str, Any] = {}
    for name, hint in _HINTS[of].items():
        value = fields.get(name) or ""
        if hint is str:
            event[name] = value
        elif hint is int:
            event[name] = int(value or 0)
        elif get_origin(hint) is list:
            event[name] = json.loads(value or "[]")
        else:  # int | None: a limit or a quota
            event[name] = int(value) if value else None
    return cast(E, event), fields


def key_from_fields(raw: Mapping[Any, Any] | Sequence[Any]) -> KeyRecord | None:
    """A key from its Redis hash; None when empty."""
    event, fields = _event(ApiKey, raw)
    if not event["id"]:
        return None
    return KeyRecord.from_event(event, last_used_ms=int(fields.get("last_used_ms") or 0))


def tenant_from_fields(raw: Mapping[Any, Any] | Sequence[Any]) -> TenantPolicy | None:
    event, _ = _event(TenantPolicyEvent, raw)
    return TenantPolicy.from_event(event) if event["name"] else None


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
                args=[record.id, record.version, *_flat(_fields(record.event()))])
        return bool(done)

    async def put_tenant(self, policy: TenantPolicy) -> bool:
        n = self.names
        with redis_boundary("storing a tenant policy"):
            done = await self._put_tenant(
                keys=[n.tenant(policy.name), n.tenants],
                args=[policy.name, policy.version, *_flat(_fields(policy.event()))])
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

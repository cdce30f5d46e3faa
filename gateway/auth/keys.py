"""API keys: made, changed and revoked through the ``keys`` topic, then the Redis
copy, then announced and audited; looked up per request from the cache, else
Redis. :meth:`KeyStore.lookup` returns revoked and expired keys too: **the
caller must check** :meth:`KeyRecord.usable`. Redis unreachable, a cached key
still works and an uncached one raises
:class:`~conveyor.errors.TransientBrokerError` (503)."""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Generic, TypeVar

from conveyor.errors import BrokerError, ConveyorError
from conveyor.redis_clients import Redis
from conveyor.settings import Settings
from gateway.audit import Audit, audit_event
from gateway.auth.cache import Invalidations, LocalCache
from gateway.auth.keys_topic import KeysTopic, Restorer
from gateway.auth.redis_copy import EVERYTHING, TENANT_PREFIX, RedisCopy
from gateway.auth.secrets import SECRET_PREFIX, hash_secret, new_key_id, new_secret
from gateway.auth.types import KeyRecord, Limits, merge_limits
from schemas.codec import Codec
from schemas.records import AuditEvent
from topics.backoff import RateLimitedLog
from topics.envelope import now_ms
from topics.producer import Producer

__all__ = ["KeyStore", "KeyNotFound", "KeyRevoked", "RecordStore"]

log = logging.getLogger(__name__)

R = TypeVar("R")


class KeyNotFound(ConveyorError):
    """No key has this id."""


class KeyRevoked(ConveyorError):
    """The key is revoked: it can no longer be changed."""


class RecordStore(Generic[R]):
    """What the key and tenant stores share: the topic, its Redis copy and restore,
    a cache of ``R`` kept current by ``invalidations`` (shareable between stores:
    run it once; without it the store makes its own)."""

    _tenants = False  # whose changes drop entries here: tenants' or keys'

    def __init__(self, settings: Settings, redis: Redis, producer: Producer | None,
                 audit: Audit | None, invalidations: Invalidations | None,
                 codec: Codec | None, negative_cache_s: float) -> None:
        self.settings = settings
        self.copy = RedisCopy(settings, redis)
        self.topic = KeysTopic(settings, producer, codec)
        self.restorer = Restorer(self.copy, self.topic)
        self.audit = audit
        self.cache: LocalCache[R] = LocalCache(settings.auth.key_cache_s, negative_cache_s)
        self.invalidations = invalidations or Invalidations(settings, redis)
        self.invalidations.add(self._on_change)

    @property
    def healthy(self) -> bool:
        """True while changes reach this replica's cache at once (subscribed)."""
        return self.invalidations.healthy

    async def _restoring(self, read: Callable[[], Awaitable[tuple[R | None, bool]]]
                         ) -> R | None:
        """``read()``'s record (it says whether Redis holds the whole topic); none
        found where Redis does not, read again once the topic is restored."""
        found, restored = await read()
        if found is None and not restored:
            await self.restorer.ensure()  # or another replica restored it meanwhile
            found, _ = await read()
        return found

    def _on_change(self, message: str) -> None:
        if message == EVERYTHING:
            self.cache.clear()
        elif message.startswith(TENANT_PREFIX) == self._tenants:
            self.cache.drop(message)

    async def _announce(self, tag: str, what: str, event: AuditEvent) -> None:
        """A change is written: drop it here, tell every replica, audit it (a
        failure of either is a warning: caches expire in ``key_cache_s``)."""
        self.cache.drop(tag)
        try:
            await self.copy.publish(tag)
        except BrokerError as exc:
            log.warning("change of %s not announced: %s", what, exc)
        if self.audit is not None:
            try:
                await self.audit.write(event)
            except Exception as exc:  # the change is made; say the audit missed it
                log.warning("audit event %s of %s not written: %r", event["action"], what,
                            exc)


class KeyStore(RecordStore[KeyRecord]):
    """The API keys of one Conveyor (``settings.kafka.topic_prefix``)."""

    def __init__(self, settings: Settings, redis: Redis,
                 producer: Producer | None = None, *, audit: Audit | None = None,
                 invalidations: Invalidations | None = None, codec: Codec | None = None,
                 negative_cache_s: float = 1.0, touch_every_s: float = 60.0) -> None:
        super().__init__(settings, redis, producer, audit, invalidations, codec, negative_cache_s)
        self.touch_every_s = touch_every_s
        self._touched: dict[str, float] = {}
        self._problems = RateLimitedLog(log)

    async def lookup(self, secret: str) -> KeyRecord | None:
        """The key of ``secret`` (usable or not: check ``usable``), None if unknown."""
        if not secret.startswith(SECRET_PREFIX):
            return None
        key_hash = hash_secret(self.settings.auth, secret)
        return await self.cache.read_through(
            key_hash, lambda: self._restoring(lambda: self.copy.find(key_hash)),
            lambda r: r.id if r else "", self.healthy)

    async def touch(self, record: KeyRecord) -> None:
        """Remember that the key was used now: at most once per ``touch_every_s`` per key
        in this process, in Redis only (not in the topic). Never raises for Redis."""
        now = time.monotonic()
        last = self._touched.get(record.id)
        if last is not None and now - last < self.touch_every_s:
            return
        self._touched[record.id] = now
        try:
            await self.copy.touch(record.id, now_ms())
        except BrokerError as exc:
            self._problems.warning("touch", "last use of key %s not recorded: %s",
                                   record.id, exc)

    async def list(self, tenant: str | None = None) -> builtins.list[KeyRecord]:
        """Every key (of ``tenant``), revoked ones included, by id."""
        await self.restorer.ensure()
        return await self.copy.list_keys(tenant)

    async def create(self, tenant: str, name: str, limits: Limits,
                     models: tuple[str, ...] = (), expires_in_s: float | None = None,
                     actor: str = "") -> tuple[KeyRecord, str]:
        """A new key and its secret, which is shown this once and kept nowhere."""
        if not tenant:
            raise ValueError("a key needs a tenant")
        if expires_in_s is not None and expires_in_s <= 0:
            raise ValueError(f"expires_in_s must be positive, not {expires_in_s}")
        limits = merge_limits(Limits(), limits)  # each limit checked before anything is made
        secret = new_secret()
        now = now_ms()
        record = KeyRecord(
            id=new_key_id(), tenant=tenant, name=name, hash=hash_secret(self.settings.auth, secret),
            limits=limits, models=tuple(m for m in models if m),
            created_ms=now, expires_ms=now + int(expires_in_s * 1000) if expires_in_s else 0,
            version=1)
        await self._write(record, "key.created", actor)
        return record, secret

    async def update(self, key_id: str, *, limits: Limits | None = None,
                     models: tuple[str, ...] | None = None, name: str | None = None,
                     actor: str = "") -> KeyRecord:
        """Change what is given: each limit given replaces (0 clears it), ``models``
        replaces the list (``()``: every model), ``name`` renames."""
        current = await self._current(key_id)
        if current.revoked_ms:
            raise KeyRevoked(f"key {key_id} is revoked; make a new one")
        record = replace(
            current, version=current.version + 1,
            limits=current.limits if limits is None else merge_limits(current.limits, limits),
            models=current.models if models is None else tuple(m for m in models if m),
            name=current.name if name is None else name)
        await self._write(record, "key.updated", actor)
        return record

    async def revoke(self, key_id: str, actor: str = "") -> KeyRecord:
        """Revoke for good (a revoked key stays revoked; revoking twice changes nothing)."""
        current = await self._current(key_id)
        if current.revoked_ms:
            return current
        record = replace(current, revoked_ms=now_ms(), version=current.version + 1)
        await self._write(record, "key.revoked", actor)
        return record

    async def restore(self) -> tuple[int, int]:
        """Rebuild Redis from the topic now; (keys, tenants) restored."""
        snapshot = await self.restorer.restore()
        return len(snapshot.keys), len(snapshot.tenants)

    async def _current(self, key_id: str) -> KeyRecord:
        await self.restorer.ensure()
        record = await self.copy.get_key(key_id)
        if record is None:
            raise KeyNotFound(f"no key with id {key_id!r}")
        return record

    async def _write(self, record: KeyRecord, action: str, actor: str) -> None:
        await self.topic.write_key(record)
        await self.copy.put_key(record)
        await self._announce(record.id, f"key {record.id}", audit_event(
            action, tenant=record.tenant, key_id=record.id, actor=actor,
            detail={"name": record.name, "models": ",".join(record.models),
                    "expires_ms": str(record.expires_ms), **record.limits.described()}))

"""Tenant policies: the limits and token quotas every key of a tenant shares.

Stored like keys (gateway/auth/keys.py): the whole policy goes to the
``keys`` topic under ``tenant:<name>`` first, then to Redis
(``{prefix}:tenant:{name}``), then ``tenant:<name>`` is published on the
change channel, then audited (``tenant.set``). A tenant whose policy was
never set has no limits and no quotas: ``TenantPolicy(name)``.

:meth:`TenantStore.set` changes what is given, like a key's update: ``None``
keeps, ``0`` clears, a positive value replaces (gateway/auth/limit_changes.py).
:meth:`TenantStore.get` is cached in process for ``settings.auth.key_cache_s``
(a tenant never set too: setting it drops the entry everywhere); when Redis
cannot be reached a cached policy still serves and an uncached one raises
:class:`~conveyor.errors.TransientBrokerError`.
"""

from __future__ import annotations

import builtins
import logging

from conveyor.errors import BrokerError, TransientBrokerError
from conveyor.redis_clients import Redis
from conveyor.settings import Settings
from gateway.audit import Audit, audit_event
from gateway.auth.cache import LocalCache
from gateway.auth.invalidations import Invalidations
from gateway.auth.keys_topic import KeysTopic
from gateway.auth.limit_changes import merge_limit, merge_limits
from gateway.auth.redis_copy import EVERYTHING, TENANT_PREFIX, RedisCopy
from gateway.auth.restore import Restorer
from gateway.auth.types import Limits, TenantPolicy
from gateway.health import TaskHealth
from schemas.codec import Codec
from topics.producer import EventProducer

__all__ = ["TenantStore"]

log = logging.getLogger(__name__)


class TenantStore:
    """The tenant policies of one Conveyor (``settings.kafka.topic_prefix``)."""

    def __init__(self, settings: Settings, redis: Redis,
                 producer: EventProducer | None = None, *, audit: Audit | None = None,
                 invalidations: Invalidations | None = None, part: TaskHealth | None = None,
                 codec: Codec | None = None) -> None:
        """``invalidations`` may be shared with a KeyStore (run it once)."""
        self.settings = settings
        self.copy = RedisCopy(settings, redis)
        self.topic = KeysTopic(settings, producer, codec)
        self.restorer = Restorer(self.copy, self.topic)
        self.audit = audit
        self.cache: LocalCache[TenantPolicy] = LocalCache(settings.auth.key_cache_s)
        self.invalidations = invalidations or Invalidations(settings, redis, part)
        self.invalidations.add(self._on_change)

    @property
    def healthy(self) -> bool:
        return self.invalidations.healthy

    def _on_change(self, message: str) -> None:
        if message == EVERYTHING:
            self.cache.clear()
        elif message.startswith(TENANT_PREFIX):
            self.cache.drop(message)

    async def get(self, name: str) -> TenantPolicy:
        """The tenant's policy; ``TenantPolicy(name)`` (no limits) if never set."""
        hit, cached = self.cache.get(name)
        if hit and cached is not None and self.cache.trusted(self.healthy):
            return cached
        generation = self.cache.generation
        try:
            policy = await self._stored(name) or TenantPolicy(name)
        except TransientBrokerError:
            if cached is None:
                raise
            self.cache.read_failed()  # Redis unreachable: the cached policy serves
            return cached
        self.cache.read_succeeded()
        self.cache.put(name, policy, TENANT_PREFIX + name, generation)
        return policy

    async def list(self) -> builtins.list[TenantPolicy]:
        """Every tenant whose policy was set, by name."""
        await self.restorer.ensure()
        return await self.copy.list_tenants()

    async def set(self, name: str, limits: Limits | None = None,
                  daily_tokens: int | None = None, monthly_tokens: int | None = None,
                  actor: str = "") -> TenantPolicy:
        """Change what is given of the tenant's policy (0 clears a limit or quota)."""
        limits = limits or Limits()
        if not name:
            raise ValueError("a tenant needs a name")
        current = await self._stored(name) or TenantPolicy(name)
        policy = TenantPolicy(
            name=name, limits=merge_limits(current.limits, limits),
            daily_tokens=merge_limit("daily_tokens", current.daily_tokens, daily_tokens),
            monthly_tokens=merge_limit("monthly_tokens", current.monthly_tokens,
                                       monthly_tokens),
            version=current.version + 1)
        await self.topic.write_tenant(policy)
        await self.copy.put_tenant(policy)
        tag = TENANT_PREFIX + name
        self.cache.drop(tag)
        try:
            await self.copy.publish(tag)
        except BrokerError as exc:
            log.warning("change of tenant %s not announced: %s", name, exc)
        if self.audit is not None:
            quotas = {"daily_tokens": policy.daily_tokens, "monthly_tokens": policy.monthly_tokens}
            detail = {**policy.limits.described(),
                      **{k: "-" if v is None else str(v) for k, v in quotas.items()}}
            try:
                await self.audit.write(audit_event("tenant.set", tenant=name, actor=actor,
                                                   detail=detail))
            except Exception as exc:
                log.warning("audit event tenant.set of %s not written: %r", name, exc)
        return policy

    async def _stored(self, name: str) -> TenantPolicy | None:
        policy, restored = await self.copy.get_tenant(name)
        if policy is None and not restored and await self.restorer.ensure():
            policy, _ = await self.copy.get_tenant(name)
        return policy

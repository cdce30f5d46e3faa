"""Tenant policies: the limits and token quotas every key of a tenant shares,
stored, cached and audited (``tenant.set``) as keys are. A tenant never set
has none: ``TenantPolicy(name)``."""

from __future__ import annotations

import builtins

from conveyor.redis_clients import Redis
from conveyor.settings import Settings
from gateway.audit import Audit, audit_event
from gateway.auth.cache import Invalidations
from gateway.auth.keys import RecordStore
from gateway.auth.redis_copy import TENANT_PREFIX
from gateway.auth.types import Limits, TenantPolicy, merge_limit, merge_limits
from schemas.codec import Codec
from topics.producer import Producer

__all__ = ["TenantStore"]


class TenantStore(RecordStore[TenantPolicy]):
    """The tenant policies of one Conveyor (``settings.kafka.topic_prefix``)."""

    _tenants = True

    def __init__(self, settings: Settings, redis: Redis,
                 producer: Producer | None = None, *, audit: Audit | None = None,
                 invalidations: Invalidations | None = None, codec: Codec | None = None) -> None:
        super().__init__(settings, redis, producer, audit, invalidations, codec, 1.0)

    async def get(self, name: str) -> TenantPolicy:
        """The tenant's policy; ``TenantPolicy(name)`` (no limits) if never set."""

        async def read() -> TenantPolicy:
            return await self._stored(name) or TenantPolicy(name)

        policy = await self.cache.read_through(name, read, lambda _: TENANT_PREFIX + name,
                                               self.healthy)
        assert policy is not None  # read never answers None
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
        quotas = {"daily_tokens": policy.daily_tokens, "monthly_tokens": policy.monthly_tokens}
        await self._announce(TENANT_PREFIX + name, f"tenant {name}", audit_event(
            "tenant.set", tenant=name, actor=actor, detail={
                **policy.limits.described(),
                **{k: "-" if v is None else str(v) for k, v in quotas.items()}}))
        return policy

    async def _stored(self, name: str) -> TenantPolicy | None:
        return await self._restoring(lambda: self.copy.get_tenant(name))

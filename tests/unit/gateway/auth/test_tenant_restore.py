"""A tenant's policy read while the keys topic is being restored into Redis."""

from __future__ import annotations

from conveyor.redis_clients import redis_client
from conveyor.settings import load_settings
from gateway.auth.tenants import TenantStore
from gateway.auth.types import Limits, TenantPolicy


async def test_a_policy_restored_by_another_replica_is_read_again() -> None:
    """Redis does not hold the whole topic; the restore this replica asks for
    finds another replica's done (ensure() answers False): the policy is read
    again, not taken for no policy."""
    settings = load_settings(topic_prefix="tr", redis_url="redis://127.0.0.1:1/0")
    store = TenantStore(settings, redis_client(settings.redis, "gateway"))
    policy = TenantPolicy("acme", limits=Limits(rpm=5))
    answers = iter([(None, False), (policy, True)])

    async def get_tenant(name: str) -> tuple[TenantPolicy | None, bool]:
        return next(answers)

    async def ensure() -> bool:
        return False

    store.copy.get_tenant = get_tenant  # type: ignore[method-assign]
    store.restorer.ensure = ensure  # type: ignore[method-assign]
    assert await store.get("acme") == policy

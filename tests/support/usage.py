"""What the accounting app's mirror holds in Redis, read as the rate limiter
reads it (gateway/auth/ratelimit_windows.py)."""

from __future__ import annotations

from typing import Literal

from topics.envelope import now_ms
from workers.usage import UsageLedger

__all__ = ["quota_total"]


async def quota_total(ledger: UsageLedger, tenant: str, period: Literal["day", "month"],
                      at_ms: int | None = None) -> int:
    """The tenant's prompt plus completion tokens of the UTC day or month that
    holds ``at_ms`` (now when None), in the quota key ``ledger``'s Redis holds."""
    at = now_ms() if at_ms is None else at_ms
    value = await ledger.redis.get(ledger.keys.quota(tenant, period, at))
    return int(value) if value is not None else 0

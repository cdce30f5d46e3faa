"""How a change of limits is spelled, for keys and tenants alike.

One rule everywhere (``KeyStore.create/update``, ``TenantStore.set``, and the
``--rpm/--tpm/--concurrency/--daily-tokens/--monthly-tokens`` flags of the
CLI): a value that is not given (``None``) keeps what is there, a positive
value replaces it, and ``0`` clears it ("no limit"). A limit of zero would
only block a key or tenant completely, which is what revoking a key is for,
so zero is free to mean "none". A negative value is an error.
"""

from __future__ import annotations

from gateway.auth.types import Limits

__all__ = ["merge_limit", "merge_limits", "check_limit"]


def check_limit(name: str, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise ValueError(f"{name} must be 0 (no limit) or positive, not {value}")
    return value


def merge_limit(name: str, current: int | None, change: int | None) -> int | None:
    """``change`` None: keep ``current``; 0: no limit; positive: the new limit."""
    check_limit(name, change)
    if change is None:
        return current
    return change or None


def merge_limits(current: Limits, change: Limits) -> Limits:
    """``current`` with every limit ``change`` gives replaced (0 clears it)."""
    return Limits(rpm=merge_limit("rpm", current.rpm, change.rpm),
                  tpm=merge_limit("tpm", current.tpm, change.tpm),
                  concurrency=merge_limit("concurrency", current.concurrency,
                                          change.concurrency))

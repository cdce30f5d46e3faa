"""The contract of auth and limits: who a request comes from and what it may use.

A key's or a JWT's limits narrow its tenant's, never widen them: a request
is admitted only when both the key's and the tenant's limits have room.
``None`` means "no limit". A change of limits (keys, tenants, the CLI's flags)
keeps what it does not give (``None``), replaces with a positive value and
clears with ``0`` (a zero limit would only block, which revoking is for).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.records import ApiKey
from schemas.records import TenantPolicy as TenantPolicyEvent

__all__ = ["Limits", "KeyRecord", "TenantPolicy", "Identity", "ANONYMOUS_TENANT",
           "merge_limit", "merge_limits"]

# the tenant of every request when auth is off
ANONYMOUS_TENANT = "default"


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (prompt + max_tokens reserved, then settled)
    concurrency: int | None = None  # requests in flight at once

    @staticmethod
    def of(event: ApiKey | TenantPolicyEvent) -> Limits:
        """The limits a key's or a tenant's event carries."""
        return Limits(rpm=event["rpm"], tpm=event["tpm"], concurrency=event["concurrency"])

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.concurrency is None

    def described(self) -> dict[str, str]:
        """Each limit as text, ``-`` for none (audit details, the CLI's lines)."""
        return {k: "-" if v is None else str(v) for k, v in
                (("rpm", self.rpm), ("tpm", self.tpm), ("concurrency", self.concurrency))}


@dataclass(frozen=True)
class KeyRecord:
    """What Conveyor keeps of an API key: never the secret, only its keyed hash."""

    id: str  # public, e.g. key_3f9a0c2d41e8b7a6
    tenant: str
    name: str
    hash: str  # hex HMAC-SHA-256(server secret, secret)
    limits: Limits = field(default_factory=Limits)
    models: tuple[str, ...] = ()  # empty: every model
    created_ms: int = 0
    expires_ms: int = 0  # 0: never
    revoked_ms: int = 0  # 0: not revoked
    last_used_ms: int = 0
    version: int = 0  # bumped by every change; the newest version wins on restore

    def usable(self, now_ms: int) -> bool:
        return not self.revoked_ms and (not self.expires_ms or now_ms < self.expires_ms)

    def state(self, now_ms: int) -> str:
        """``active``, ``expired`` or ``revoked``."""
        if self.revoked_ms:
            return "revoked"
        return "active" if self.usable(now_ms) else "expired"

    def event(self) -> ApiKey:
        """The key as the ``keys`` topic holds it (its Redis hash: the same, as text)."""
        return ApiKey(id=self.id, tenant=self.tenant, name=self.name, hash=self.hash,
                      rpm=self.limits.rpm, tpm=self.limits.tpm,
                      concurrency=self.limits.concurrency, models=list(self.models),
                      created_ms=self.created_ms, expires_ms=self.expires_ms,
                      revoked_ms=self.revoked_ms, version=self.version)

    @staticmethod
    def from_event(event: ApiKey, last_used_ms: int = 0) -> KeyRecord:
        return KeyRecord(id=event["id"], tenant=event["tenant"], name=event["name"],
                         hash=event["hash"], limits=Limits.of(event),
                         models=tuple(event["models"]), created_ms=event["created_ms"],
                         expires_ms=event["expires_ms"], revoked_ms=event["revoked_ms"],
                         last_used_ms=last_used_ms, version=event["version"])


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    limits: Limits = field(default_factory=Limits)
    daily_tokens: int | None = None  # quota, UTC day
    monthly_tokens: int | None = None  # quota, UTC calendar month
    version: int = 0

    def event(self) -> TenantPolicyEvent:
        """The policy as the ``keys`` topic holds it (its Redis hash: the same, as text)."""
        return TenantPolicyEvent(name=self.name, rpm=self.limits.rpm, tpm=self.limits.tpm,
                                 concurrency=self.limits.concurrency,
                                 daily_tokens=self.daily_tokens,
                                 monthly_tokens=self.monthly_tokens, version=self.version)

    @staticmethod
    def from_event(event: TenantPolicyEvent) -> TenantPolicy:
        return TenantPolicy(name=event["name"], limits=Limits.of(event),
                            daily_tokens=event["daily_tokens"],
                            monthly_tokens=event["monthly_tokens"], version=event["version"])


@dataclass(frozen=True)
class Identity:
    """An authenticated caller, as the gateway writes it into the envelope."""

    tenant: str
    key_id: str  # "" when auth is off; a JWT's is "jwt:<sub>"
    limits: Limits = field(default_factory=Limits)  # the key's (or the token's) own
    models: frozenset[str] | None = None  # None: every model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def merge_limit(name: str, current: int | None, change: int | None) -> int | None:
    """``change`` None: keep ``current``; 0: no limit; positive: the new limit."""
    if change is None:
        return current
    if change < 0:
        raise ValueError(f"{name} must be 0 (no limit) or positive, not {change}")
    return change or None


def merge_limits(current: Limits, change: Limits) -> Limits:
    """``current`` with every limit ``change`` gives replaced (0 clears it)."""
    return Limits(rpm=merge_limit("rpm", current.rpm, change.rpm),
                  tpm=merge_limit("tpm", current.tpm, change.tpm),
                  concurrency=merge_limit("concurrency", current.concurrency,
                                          change.concurrency))

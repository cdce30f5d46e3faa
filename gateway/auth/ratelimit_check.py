"""What one rate-limit check asks and what it finds, whichever windows answer it.

The rate limiter (:mod:`gateway.auth.ratelimit`) asks a :class:`Check` of
the windows in Redis (:mod:`gateway.auth.ratelimit_lua`) or, while Redis
cannot be reached, of this process's own (:mod:`gateway.auth.ratelimit_local`);
both answer with a :class:`Verdict` of the same shape, so that the headers
and errors a client sees are written in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.auth.types import Limits

__all__ = ["Kind", "KINDS", "WINDOW_MS", "Scope", "Check", "Measure", "Verdict"]

Kind = Literal["requests", "tokens", "concurrency"]
KINDS: tuple[Kind, ...] = ("requests", "tokens", "concurrency")

# rpm and tpm are counted over an exact rolling window of one minute
WINDOW_MS = 60_000


@dataclass(frozen=True)
class Scope:
    """One set of limits a request counts against: its key's or its tenant's."""

    id: str  # "key:<key id>" or "tenant:<name>": part of the Redis key names
    label: str  # "key key_3f9a…" or "tenant acme": how messages name it
    limits: Limits

    def limit(self, kind: Kind) -> int | None:
        if kind == "requests":
            return self.limits.rpm
        if kind == "tokens":
            return self.limits.tpm
        return self.limits.concurrency


@dataclass(frozen=True)
class Check:
    """One admission to check and, when everything has room, to count."""

    member: str  # unique per admission: the request id and a nonce
    tokens: int  # reserved: prompt tokens + max_tokens
    deadline_ms: int  # epoch ms; the concurrency slot lapses then if never settled
    scopes: tuple[Scope, ...]
    daily_tokens: int | None = None  # the tenant's quotas (checked in Redis only)
    monthly_tokens: int | None = None
    tenant: str = ""
    day: str = ""  # UTC "YYYY-MM-DD" and "YYYY-MM" of the quota counters
    month: str = ""


@dataclass(frozen=True)
class Measure:
    """One limit of one scope, as the check found it."""

    kind: Kind
    limit: int
    used: int  # in the window (in flight): after this admission when admitted
    reset_ms: int  # until the oldest entry leaves the window (remaining grows)
    retry_ms: int | None = None  # refused by this limit: until this request fits

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class Verdict:
    """The answer: every limited measure of every scope, and whether it passed."""

    admitted: bool
    measures: tuple[tuple[Scope, Measure], ...] = ()
    quota: Literal["day", "month"] | None = None  # set when a quota refused it
    quota_used: int = 0
    quota_limit: int = 0

    def refusals(self) -> list[tuple[Scope, Measure]]:
        return [(s, m) for s, m in self.measures if m.retry_ms is not None]

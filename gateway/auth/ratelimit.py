"""Rate limits and quotas of a key and its tenant, exact across gateway replicas
(docs/operating/keys-and-limits.md#limits).

A request is admitted only when every limit (rpm, tpm, concurrency, daily and
monthly token quotas) has room; tpm reserves prompt + ``max_tokens`` and
:meth:`RateLimiter.settle` corrects it (never raising: the windows heal). A
refusal is a 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers.
Redis unusable is never a 500: ``limits_when_redis_down`` ``closed`` answers
503, ``share`` counts this gateway's share in memory, probing Redis again."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from conveyor.errors import PipelineUnavailable, QuotaExceeded, RateLimited
from conveyor.redis_clients import REDIS_ERRORS, Redis, reply_lease_key
from conveyor.settings import Settings
from gateway.auth.ratelimit_windows import Check, LocalWindows, RedisWindows, Scope, Verdict
from gateway.auth.types import Identity, TenantPolicy
from gateway.health import TaskHealth
from topics.backoff import RateLimitedLog

__all__ = ["Admission", "RateLimiter", "format_duration"]

log = logging.getLogger(__name__)

# what makes Redis unusable for a moment: the limiter falls back, never a 500
_OUTAGE = REDIS_ERRORS


def format_duration(ms: int) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``120ms``,
    ``1s``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{minutes}m{seconds}"
    return seconds


@dataclass
class Admission:
    """What :meth:`RateLimiter.admit` granted; :meth:`RateLimiter.settle` takes it back."""

    request_id: str
    member: str  # the admission's entry in every window
    scopes: tuple[Scope, ...]
    tokens: int  # reserved
    headers: dict[str, str]  # OpenAI's x-ratelimit-* for the response
    backend: Literal["none", "redis", "local"]  # who counted it (and settles it)
    settled: bool = False


class RateLimiter:
    """Admits requests against the limits of their key and tenant."""

    redis_timeout_s = 1.0  # an admission waits no longer for Redis
    probe_every_s = 0.5  # while Redis is down, how often it is tried again

    def __init__(self, settings: Settings, redis: Redis, gateway_id: str) -> None:
        self.settings = settings
        self.redis = redis
        self.gateway_id = gateway_id
        self.health = TaskHealth("limits")
        self.windows = RedisWindows(redis, settings.kafka.topic_prefix)
        self.local = LocalWindows()
        self.live_gateways = 1  # last counted while Redis answered
        self.count_every_s = max(0.2, settings.gateway.reply_lease_ttl_s / 3)
        self.redis_up = True
        self._next_probe = 0.0
        self._log = RateLimitedLog(log)

    # -- admission -----------------------------------------------------------

    async def admit(self, identity: Identity, tenant: TenantPolicy, request_id: str,
                    tokens: int, deadline_ms: int, count: bool = True) -> Admission:
        """Admit (429 when a limit or quota has no room); ``count`` false: only
        say so, counting nothing (the admission it returns is not to be settled)."""
        scopes = _scopes(identity, tenant)
        member = f"{request_id}:{secrets.token_hex(4)}"
        has_quota = tenant.daily_tokens is not None or tenant.monthly_tokens is not None
        if not scopes and not has_quota:
            return Admission(request_id, member, (), tokens, {}, "none")
        tokens = max(0, tokens)
        _refuse_never_fitting(scopes, tokens)
        if deadline_ms <= 0:  # no deadline given: the gateway's own request timeout
            deadline_ms = time.time_ns() // 1_000_000 + int(
                self.settings.gateway.request_timeout_s * 1000)
        today = datetime.now(UTC)
        check = Check(member=member, tokens=tokens, deadline_ms=deadline_ms, scopes=scopes,
                      daily_tokens=tenant.daily_tokens, monthly_tokens=tenant.monthly_tokens,
                      tenant=tenant.name, day=today.strftime("%Y-%m-%d"),
                      month=today.strftime("%Y-%m"))
        if self._try_redis():
            try:
                async with asyncio.timeout(self.redis_timeout_s):
                    verdict = await self.windows.admit(check, count)
            except _OUTAGE as exc:
                self._went_down(exc)
            else:
                self._came_back()
                return _decide(check, verdict, "redis", request_id)
        if self.settings.auth.limits_when_redis_down == "closed":
            raise PipelineUnavailable(
                "Rate limits cannot be checked: Redis is unreachable, and this gateway "
                "refuses limited requests until it answers again. Please retry shortly.",
                headers={"Retry-After": "1"})
        return _decide(check, self.local.admit(check, self.live_gateways, count), "local",
                       request_id)

    async def settle(self, admission: Admission, used_tokens: int) -> None:
        """The request ended having used ``used_tokens`` (prompt + completion):
        free its concurrency slot and correct its token reservation. Idempotent;
        never raises."""
        if admission.settled or not admission.scopes:
            return
        admission.settled = True
        used = max(0, used_tokens)
        if admission.backend == "local":
            self.local.settle(admission.member, admission.scopes, used)
            return
        try:
            async with asyncio.timeout(self.redis_timeout_s):
                await self.windows.settle(admission.member, admission.scopes, used)
        except _OUTAGE as exc:
            self._log.warning("settle", "rate limits: request %s could not be settled in "
                              "Redis (%r); its window and deadline will free it",
                              admission.request_id, exc)
        except Exception as exc:  # a bug must not fail the response it settles
            self._log.error("settle-failed", "rate limits: settling request %s failed: %r",
                            admission.request_id, exc)

    # -- Redis up or down ----------------------------------------------------

    async def run(self, health: TaskHealth | None = None) -> None:
        """Count the live gateways while Redis answers (this gateway's share when it
        does not), else probe it; load the scripts first and whenever Redis comes
        back. Survives outages; ``health`` (``degraded`` while down) replaces :attr:`health`."""
        if health is not None:
            self.health = health
        warm = False  # the scripts are loaded since Redis last answered
        while True:
            try:
                async with asyncio.timeout(max(self.redis_timeout_s, self.count_every_s)):
                    if not warm or not self.redis_up:
                        await self.windows.warm()
                        warm = True
                    self.live_gateways = await self.count_gateways()
            except _OUTAGE as exc:
                self._went_down(exc)
            except Exception as exc:  # not an outage: show it, keep going
                if self.health.set("failed", repr(exc)):
                    log.exception("rate limits: counting gateways failed")
            else:
                self._came_back()
            self.local.forget_idle()
            await asyncio.sleep(self.count_every_s if self.redis_up else self.probe_every_s)

    async def count_gateways(self) -> int:
        """How many gateways hold a reply-partition lease now (at least 1)."""
        pattern = _glob_escape(reply_lease_key(self.settings.kafka.topic_prefix, "")) + "*"
        count = 0
        async for _ in self.redis.scan_iter(match=pattern, count=1000):
            count += 1
        return max(1, count)

    def _try_redis(self) -> bool:
        if self.redis_up:
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + self.probe_every_s
        return True

    def _went_down(self, exc: BaseException) -> None:
        self._next_probe = time.monotonic() + self.probe_every_s
        if self.settings.auth.limits_when_redis_down == "closed":
            then = "refusing limited requests (503) until it answers"
        else:
            then = (f"each limit is enforced here, divided by {self.live_gateways} "
                    "live gateway(s); quotas are not checked")
        self.health.set("degraded", f"Redis unreachable: {exc!r}")
        if self.redis_up:
            self.redis_up = False
            self._log.warning("redis-down", "rate limits: Redis unreachable (%r): %s",
                              exc, then)

    def _came_back(self) -> None:
        self.health.set("ok", f"Redis; {self.live_gateways} live gateway(s)")
        if not self.redis_up:
            self.redis_up = True
            self._log.resolved("redis-down", "rate limits: Redis answers again; limits "
                               "are counted there")


# -- what a verdict becomes -----------------------------------------------------

def _scopes(identity: Identity, tenant: TenantPolicy) -> tuple[Scope, ...]:
    scopes = []
    if not identity.limits.unlimited:
        scopes.append(Scope(f"key:{identity.key_id}", f"key {identity.key_id}",
                            identity.limits))
    if not tenant.limits.unlimited:
        scopes.append(Scope(f"tenant:{tenant.name}", f"tenant {tenant.name}", tenant.limits))
    return tuple(scopes)


def _refuse_never_fitting(scopes: tuple[Scope, ...], tokens: int) -> None:
    for scope in scopes:
        tpm = scope.limits.tpm
        if tpm is not None and tokens > tpm:
            raise RateLimited(
                f"Request too large for tokens per minute ({scope.label}): limit {tpm}, "
                f"requested {tokens} (prompt tokens + max_tokens). It can never fit: lower "
                "max_tokens or shorten the prompt.",
                type="tokens", headers={"x-ratelimit-limit-tokens": str(tpm)})


def _decide(check: Check, verdict: Verdict, backend: Literal["redis", "local"],
            request_id: str) -> Admission:
    if verdict.quota is not None:
        raise _quota_exceeded(check, verdict)
    headers = _headers(verdict)
    if not verdict.admitted:
        raise _rate_limited(check, verdict, headers, backend)
    return Admission(request_id, check.member, check.scopes, check.tokens, headers, backend)


def _headers(verdict: Verdict) -> dict[str, str]:
    """The six ``x-ratelimit-*`` of the tighter scope per kind (omitted when unlimited)."""
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        measures = [m for _, m in verdict.measures if m.kind == kind]
        if not measures:
            continue
        tight = min(measures, key=lambda m: (m.remaining, m.limit))
        reset = tight.retry_ms if tight.retry_ms is not None else tight.reset_ms
        headers[f"x-ratelimit-limit-{kind}"] = str(tight.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(tight.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = format_duration(reset)
    return headers


def _rate_limited(check: Check, verdict: Verdict, headers: dict[str, str],
                  backend: str) -> RateLimited:
    """The refusal that holds the request back longest names the limit; all must
    have room, so ``Retry-After`` is the latest moment any of them opens."""
    scope, binding = max(verdict.refusals(), key=lambda sm: sm[1].retry_ms or 0)
    retry_s = max(1, math.ceil((binding.retry_ms or 0) / 1000))
    if binding.kind == "requests":
        message = (f"Rate limit reached for requests per minute ({scope.label}): "
                   f"limit {binding.limit}, used {binding.used}.")
    elif binding.kind == "tokens":
        message = (f"Rate limit reached for tokens per minute ({scope.label}): limit "
                   f"{binding.limit}, used {binding.used}, requested {check.tokens}.")
    else:
        message = (f"Rate limit reached for concurrent requests ({scope.label}): limit "
                   f"{binding.limit}, in flight {binding.used}.")
    if backend == "local":
        message += " (This gateway's share of the limit: Redis is unreachable.)"
    message += f" Please try again in {retry_s}s."
    return RateLimited(message, type="tokens" if binding.kind == "tokens" else "requests",
                       headers={"Retry-After": str(retry_s), **headers})


def _quota_exceeded(check: Check, verdict: Verdict) -> QuotaExceeded:
    now = datetime.now(UTC)
    midnight = datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)
    if verdict.quota == "day":
        period, renews = "daily", midnight
    else:
        period = "monthly"
        renews = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    retry_s = max(1, math.ceil((renews - now).total_seconds()))
    return QuotaExceeded(
        f"You exceeded your {period} token quota (tenant {check.tenant}): "
        f"{verdict.quota_used} of {verdict.quota_limit} tokens used. It renews at "
        f"{renews:%Y-%m-%d %H:%M} UTC.", headers={"Retry-After": str(retry_s)})


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)

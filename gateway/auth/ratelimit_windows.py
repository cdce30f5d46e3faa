"""The rate-limit windows that answer a :class:`Check` with a :class:`Verdict`:
:class:`RedisWindows`, one Lua script shared by every gateway that checks and
counts atomically on Redis's clock (layout:
docs/decisions/0026-keys-and-limits-in-redis.md), or :class:`LocalWindows`,
this process's share of each limit while Redis cannot be reached (without
quotas, started empty). Both answer in one shape."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

from conveyor.redis_clients import Redis
from gateway.auth.types import Limits

__all__ = ["Kind", "KINDS", "WINDOW_MS", "Scope", "Check", "Measure", "Verdict",
           "LocalWindows", "RedisWindows", "ADMIT_LUA", "SETTLE_LUA"]

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


# -- in this process, while Redis is down -------------------------------------

@dataclass
class _ScopeWindows:
    requests: deque[int] = field(default_factory=deque)  # admission times, ms
    tokens: OrderedDict[str, tuple[int, int]] = field(default_factory=OrderedDict)
    token_sum: int = 0
    inflight: dict[str, int] = field(default_factory=dict)  # member -> deadline ms

    def trim(self, now: int) -> None:
        cutoff = now - WINDOW_MS
        while self.requests and self.requests[0] <= cutoff:
            self.requests.popleft()
        while self.tokens:
            member, (at, tokens) = next(iter(self.tokens.items()))
            if at > cutoff:
                break
            del self.tokens[member]
            self.token_sum -= tokens
        self.token_sum = max(0, self.token_sum) if self.tokens else 0
        for member in [m for m, d in self.inflight.items() if d <= now]:
            del self.inflight[member]

    @property
    def empty(self) -> bool:
        return not (self.requests or self.tokens or self.inflight)


class LocalWindows:
    """In-memory windows per scope, checked against a share of each limit (together
    the gateways admit about the limit, a little more where it is below their
    number); what Redis admitted before the outage is not known here."""

    def __init__(self) -> None:
        self._scopes: dict[str, _ScopeWindows] = {}

    @staticmethod
    def share(limit: int, gateways: int) -> int:
        return max(1, limit // max(1, gateways))

    def admit(self, check: Check, gateways: int, count: bool = True) -> Verdict:
        """Admit ``check`` if every window has room; ``count`` false: only measure."""
        now = time.time_ns() // 1_000_000
        found: list[tuple[Scope, _ScopeWindows, Measure]] = []
        for scope in check.scopes:
            windows = self._scopes.setdefault(scope.id, _ScopeWindows())
            windows.trim(now)
            for kind in KINDS:
                limit = scope.limit(kind)
                if limit is not None:
                    measure = self._measure(windows, kind, self.share(limit, gateways),
                                            now, asking=check.tokens)
                    found.append((scope, windows, measure))
        admitted = all(m.retry_ms is None for _, _, m in found)
        if admitted and count:
            for _, windows, measure in found:
                self._count(windows, measure.kind, check, now)
            found = [(s, w, self._measure(w, m.kind, m.limit, now, asking=None))
                     for s, w, m in found]
        return Verdict(admitted=admitted, measures=tuple((s, m) for s, _, m in found))

    def settle(self, member: str, scopes: tuple[Scope, ...], used_tokens: int) -> None:
        for scope in scopes:
            windows = self._scopes.get(scope.id)
            if windows is None:
                continue
            windows.inflight.pop(member, None)
            if member in windows.tokens:
                at, reserved = windows.tokens[member]
                windows.tokens[member] = (at, used_tokens)
                windows.token_sum = max(0, windows.token_sum + used_tokens - reserved)

    def forget_idle(self) -> None:
        """Drop the windows of scopes that hold nothing any more."""
        now = time.time_ns() // 1_000_000
        for scope_id in list(self._scopes):
            self._scopes[scope_id].trim(now)
            if self._scopes[scope_id].empty:
                del self._scopes[scope_id]

    @staticmethod
    def _count(windows: _ScopeWindows, kind: Kind, check: Check, now: int) -> None:
        if kind == "requests":
            windows.requests.append(now)
        elif kind == "tokens":
            windows.tokens[check.member] = (now, check.tokens)
            windows.token_sum += check.tokens
        else:
            windows.inflight[check.member] = check.deadline_ms

    @staticmethod
    def _measure(windows: _ScopeWindows, kind: Kind, limit: int, now: int,
                 asking: int | None) -> Measure:
        """The window of ``kind`` against ``limit``; ``asking`` is the tokens of
        one more admission, to ask whether it fits (None: only measure)."""
        if kind == "requests":
            used = len(windows.requests)
            reset = windows.requests[0] + WINDOW_MS - now if windows.requests else 0
            retry = None
            if asking is not None and used + 1 > limit:
                index = used - limit
                retry = (max(1, windows.requests[index] + WINDOW_MS - now)
                         if 0 <= index < used else WINDOW_MS)
            return Measure(kind, limit, used, max(0, reset), retry)
        if kind == "tokens":
            used = windows.token_sum
            first = next(iter(windows.tokens.values()), None)
            reset = first[0] + WINDOW_MS - now if first else 0
            retry = None
            if asking is not None and used + asking > limit:
                retry = WINDOW_MS
                freed = 0
                for at, reserved in windows.tokens.values():
                    freed += reserved
                    if used - freed + asking <= limit:
                        retry = max(1, at + WINDOW_MS - now)
                        break
            return Measure(kind, limit, used, max(0, reset), retry)
        used = len(windows.inflight)
        retry = None
        if asking is not None and used + 1 > limit:
            earliest = min(windows.inflight.values(), default=now + 1000)
            retry = max(1, min(1000, earliest - now))
        return Measure(kind, limit, used, 0, retry)


# -- in Redis ----------------------------------------------------------------

# KEYS: per scope (requests, tokens, tokens:n, inflight), then quota day, month.
# ARGV: window ms, member, tokens, deadline ms, scopes, daily quota, monthly quota
# (-1: none), then per scope rpm, tpm, concurrency (-1: none), then 0 to measure
# without counting (1: count, the admission).
# Reply: status (1 admitted, 0 refused, 2 quota), quota period (1 day, 2 month),
# quota used, quota limit, then per scope and kind: limit, used, reset ms, retry
# ms (-1: fits).
ADMIT_LUA = """
local window = tonumber(ARGV[1])
local member = ARGV[2]
local tokens = tonumber(ARGV[3])
local deadline = tonumber(ARGV[4])
local nscopes = tonumber(ARGV[5])
local counting = ARGV[8 + nscopes * 3] ~= '0'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window

local quotas = {tonumber(ARGV[6]), tonumber(ARGV[7])}
for q = 1, 2 do
  if quotas[q] >= 0 then
    local used = tonumber(redis.call('GET', KEYS[nscopes * 4 + q])) or 0
    if used >= quotas[q] then return {2, q, used, quotas[q]} end
  end
end

local function oldest(zkey)
  local e = redis.call('ZRANGE', zkey, 0, 0, 'WITHSCORES')
  if e[2] then return math.max(0, tonumber(e[2]) + window - now) end
  return 0
end

local function trim_tokens(zkey, hkey)
  local sum = tonumber(redis.call('HGET', hkey, '#sum')) or 0
  local trimmed = false
  while true do
    local old = redis.call('ZRANGEBYSCORE', zkey, '-inf', cutoff, 'LIMIT', 0, 256)
    if #old == 0 then break end
    local vals = redis.call('HMGET', hkey, unpack(old))
    for i = 1, #old do sum = sum - (tonumber(vals[i]) or 0) end
    redis.call('ZREM', zkey, unpack(old))
    redis.call('HDEL', hkey, unpack(old))
    trimmed = true
  end
  if redis.call('ZCARD', zkey) == 0 then
    redis.call('DEL', hkey)
    return 0
  end
  if sum < 0 then sum = 0 end
  if trimmed then redis.call('HSET', hkey, '#sum', string.format('%d', sum)) end
  return sum
end

local function tokens_retry(zkey, hkey, sum, limit)
  local freed = 0
  local e = redis.call('ZRANGE', zkey, 0, 1023, 'WITHSCORES')
  for i = 1, #e, 2 do
    freed = freed + (tonumber(redis.call('HGET', hkey, e[i])) or 0)
    if sum - freed + tokens <= limit then
      return math.max(1, tonumber(e[i + 1]) + window - now)
    end
  end
  return window
end

-- first pass: trim and measure every limited window
local found = {}
local refused = false
for s = 0, nscopes - 1 do
  local req, tok, tokn, fly = KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  local rpm, tpm, cap = tonumber(ARGV[8+s*3]), tonumber(ARGV[9+s*3]), tonumber(ARGV[10+s*3])
  local m = {{-1, 0, 0, -1}, {-1, 0, 0, -1}, {-1, 0, 0, -1}}
  if rpm >= 0 then
    redis.call('ZREMRANGEBYSCORE', req, '-inf', cutoff)
    local n = redis.call('ZCARD', req)
    local retry = -1
    if n + 1 > rpm then
      local e = redis.call('ZRANGE', req, n - rpm, n - rpm, 'WITHSCORES')
      retry = window
      if e[2] then retry = math.max(1, tonumber(e[2]) + window - now) end
    end
    m[1] = {rpm, n, 0, retry}
  end
  if tpm >= 0 then
    local sum = trim_tokens(tok, tokn)
    local retry = -1
    if sum + tokens > tpm then retry = tokens_retry(tok, tokn, sum, tpm) end
    m[2] = {tpm, sum, 0, retry}
  end
  if cap >= 0 then
    redis.call('ZREMRANGEBYSCORE', fly, '-inf', now)
    local n = redis.call('ZCARD', fly)
    local retry = -1
    if n + 1 > cap then
      local e = redis.call('ZRANGE', fly, 0, 0, 'WITHSCORES')
      retry = 1000
      if e[2] then retry = math.max(1, math.min(1000, tonumber(e[2]) - now)) end
    end
    m[3] = {cap, n, 0, retry}
  end
  for k = 1, 3 do if m[k][4] >= 0 then refused = true end end
  found[s + 1] = m
end

-- second pass: count the admission everywhere, only if everything had room
for s = 0, nscopes - 1 do
  local req, tok, tokn, fly = KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  local m = found[s + 1]
  if counting and not refused then
    if m[1][1] >= 0 then
      redis.call('ZADD', req, now, member)
      redis.call('PEXPIRE', req, window + 1000)
      m[1][2] = m[1][2] + 1
    end
    if m[2][1] >= 0 then
      local sum = m[2][2] + tokens
      redis.call('ZADD', tok, now, member)
      redis.call('HSET', tokn, member, tokens, '#sum', string.format('%d', sum))
      redis.call('PEXPIRE', tok, window + 1000)
      redis.call('PEXPIRE', tokn, window + 1000)
      m[2][2] = sum
    end
    if m[3][1] >= 0 then
      redis.call('ZADD', fly, deadline, member)
      local keep = deadline - now + 1000
      if redis.call('PTTL', fly) < keep then redis.call('PEXPIRE', fly, keep) end
      m[3][2] = m[3][2] + 1
    end
  end
  if m[1][1] >= 0 then m[1][3] = oldest(req) end
  if m[2][1] >= 0 then m[2][3] = oldest(tok) end
end

local reply = {1, 0, 0, 0}
if refused then reply[1] = 0 end
for s = 1, nscopes do
  for k = 1, 3 do
    for i = 1, 4 do table.insert(reply, found[s][k][i]) end
  end
end
return reply
"""

# KEYS: per scope (tokens, tokens:n, inflight). ARGV: member, used tokens.
# Frees the concurrency slot and corrects the reservation to what was used, in
# windows that still hold the admission; idempotent.
SETTLE_LUA = """
local member = ARGV[1]
local used = tonumber(ARGV[2])
for s = 0, #KEYS / 3 - 1 do
  local tok, tokn, fly = KEYS[s*3+1], KEYS[s*3+2], KEYS[s*3+3]
  redis.call('ZREM', fly, member)
  if redis.call('ZSCORE', tok, member) then
    local old = tonumber(redis.call('HGET', tokn, member)) or 0
    local sum = (tonumber(redis.call('HGET', tokn, '#sum')) or 0) + used - old
    if sum < 0 then sum = 0 end
    redis.call('HSET', tokn, member, used, '#sum', string.format('%d', sum))
    if redis.call('PTTL', tokn) < 0 then
      redis.call('PEXPIRE', tokn, math.max(1, redis.call('PTTL', tok)))
    end
  end
end
return 1
"""


def _none_as(value: int | None) -> int:
    return -1 if value is None else value


class RedisWindows:
    """The windows of every scope in one Redis, shared by all gateways."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.prefix = prefix
        self._admit = redis.register_script(ADMIT_LUA)
        self._settle = redis.register_script(SETTLE_LUA)

    async def warm(self) -> None:
        """Load both scripts into Redis (at start, and again after Redis came
        back, its script cache empty): an admission's EVALSHA then never pays a
        NOSCRIPT round trip and a load on top of its time budget."""
        for script in (self._admit, self._settle):
            await script.registered_client.script_load(script.script)

    def scope_key(self, scope: Scope, window: str) -> str:
        """``window`` is ``requests``, ``tokens``, ``tokens:n`` or ``inflight``."""
        return f"{self.prefix}:ratelimit:{scope.id}:{window}"

    def quota_keys(self, check: Check) -> tuple[str, str]:
        base = f"{self.prefix}:usage:{check.tenant}"
        return f"{base}:day:{check.day}", f"{base}:month:{check.month}"

    async def admit(self, check: Check, count: bool = True) -> Verdict:
        keys: list[str] = []
        args: list[int | str] = [WINDOW_MS, check.member, check.tokens, check.deadline_ms,
                                 len(check.scopes), _none_as(check.daily_tokens),
                                 _none_as(check.monthly_tokens)]
        for scope in check.scopes:
            keys += [self.scope_key(scope, w)
                     for w in ("requests", "tokens", "tokens:n", "inflight")]
            args += [_none_as(scope.limit(kind)) for kind in KINDS]
        keys += self.quota_keys(check)
        args.append(int(count))
        reply: list[Any] = await self._admit(keys=keys, args=args)
        return _verdict(check, [int(v) for v in reply])

    async def settle(self, member: str, scopes: tuple[Scope, ...], used_tokens: int) -> None:
        keys = [self.scope_key(scope, w) for scope in scopes
                for w in ("tokens", "tokens:n", "inflight")]
        await self._settle(keys=keys, args=[member, used_tokens])


def _verdict(check: Check, reply: list[int]) -> Verdict:
    status, period, quota_used, quota_limit = reply[:4]
    if status == 2:
        return Verdict(admitted=False, quota="day" if period == 1 else "month",
                       quota_used=quota_used, quota_limit=quota_limit)
    measures: list[tuple[Scope, Measure]] = []
    at = 4
    for scope in check.scopes:
        for kind in KINDS:
            limit, used, reset_ms, retry_ms = reply[at:at + 4]
            at += 4
            if limit >= 0:
                measures.append((scope, Measure(kind, limit, used, reset_ms,
                                                retry_ms if retry_ms >= 0 else None)))
    return Verdict(admitted=status == 1, measures=tuple(measures))

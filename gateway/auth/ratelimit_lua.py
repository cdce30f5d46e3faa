"""The rate-limit windows in Redis: one Lua script checks and counts an admission.

Its keys (per scope ``key:<id>`` or ``tenant:<name>``: an rpm ZSET, a tpm ZSET
with a HASH of tokens and their ``#sum``, an in-flight ZSET scored by
deadline; the usage totals it reads for quotas) are laid out in
docs/decisions/0026-keys-and-limits-in-redis.md. The script takes the time
from Redis, trims, checks every limit and counts the admission in all of them
only when all have room, atomically; every key gets a TTL, missing keys read
as empty (a flushed Redis counts afresh), and all keys must live on one
Redis."""

from __future__ import annotations

from typing import Any

from conveyor.redis_clients import Redis
from gateway.auth.ratelimit_check import KINDS, WINDOW_MS, Check, Measure, Scope, Verdict

__all__ = ["RedisWindows", "ADMIT_LUA", "SETTLE_LUA"]

# KEYS: per scope (requests, tokens, tokens:n, inflight), then quota day, month.
# ARGV: window ms, member, tokens, deadline ms, scopes, daily quota, monthly quota
# (-1: none), then per scope rpm, tpm, concurrency (-1: none).
# Reply: status (1 admitted, 0 refused, 2 quota), quota period (1 day, 2 month),
# quota used, quota limit, then per scope and kind: limit, used, reset ms, retry
# ms (-1: fits).
ADMIT_LUA = """
local window = tonumber(ARGV[1])
local member = ARGV[2]
local tokens = tonumber(ARGV[3])
local deadline = tonumber(ARGV[4])
local nscopes = tonumber(ARGV[5])
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
  if not refused then
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

    async def admit(self, check: Check) -> Verdict:
        keys: list[str] = []
        args: list[int | str] = [WINDOW_MS, check.member, check.tokens, check.deadline_ms,
                                 len(check.scopes), _none_as(check.daily_tokens),
                                 _none_as(check.monthly_tokens)]
        for scope in check.scopes:
            keys += [self.scope_key(scope, w)
                     for w in ("requests", "tokens", "tokens:n", "inflight")]
            args += [_none_as(scope.limit(kind)) for kind in KINDS]
        keys += self.quota_keys(check)
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

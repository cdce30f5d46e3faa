"""The rate-limit windows of one gateway process, for while Redis cannot be reached.

With ``limits_when_redis_down = "share"`` each gateway enforces, on its own,
its share of every limit: the limit divided by the number of gateways it last
saw alive (the reply-partition leases in Redis), at least 1 per limit, so
that together they admit about the limit (a little more when a limit is
smaller than the number of gateways). The windows are the same as in Redis
(an exact rolling minute for rpm and tpm, in-flight slots that lapse at their
deadline) but start empty: what was admitted through Redis in the minute
before the outage is not known here. Quotas are not checked while Redis is
down. A request whose reservation exceeds this gateway's share of tpm is
refused until Redis answers again (a retry may then pass).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.auth.ratelimit_check import KINDS, WINDOW_MS, Check, Kind, Measure, Scope, Verdict

__all__ = ["LocalWindows"]


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
    """In-memory windows per scope, checked against a share of each limit."""

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._scopes: dict[str, _ScopeWindows] = {}

    @staticmethod
    def share(limit: int, gateways: int) -> int:
        return max(1, limit // max(1, gateways))

    def admit(self, check: Check, gateways: int) -> Verdict:
        now = self._clock_ms()
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
        if admitted:
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
        now = self._clock_ms()
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

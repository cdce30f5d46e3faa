"""The in-process cache in front of the Redis copy: answers without a round trip.

An entry is trusted for ``ttl_s`` (``key_cache_s``), a negative one for
``negative_ttl_s`` (1 s); :meth:`drop` removes entries by tag (a key id or
``tenant:<name>``) for each invalidation. :meth:`put` takes the
:attr:`generation` seen before its read and stores nothing if an invalidation
came since. While the replica is not subscribed, :meth:`trusted` says to read
Redis first and use the cache only when that read fails (then alone for
``distrust_retry_s``), so a key revoked as Redis returns is refused at once."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["LocalCache"]

V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    value: V | None
    tag: str
    expires: float


class LocalCache(Generic[V]):
    """``key -> value or None`` with a time limit per entry and drops by tag."""

    def __init__(self, ttl_s: float, negative_ttl_s: float = 1.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic,
                 distrust_retry_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self.distrust_retry_s = distrust_retry_s
        self._read_failed_at: float | None = None
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.generation = 0
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()
        self._by_tag: dict[str, set[str]] = {}

    def get(self, key: str) -> tuple[bool, V | None]:
        """(hit, value): a hit with None is a fresh "no such thing"."""
        entry = self._entries.get(key)
        if entry is None:
            return False, None
        if self.clock() >= entry.expires:
            self._remove(key)
            return False, None
        return True, entry.value

    def trusted(self, subscribed: bool) -> bool:
        """Whether a hit may answer without reading Redis: always while ``subscribed``,
        else only within ``distrust_retry_s`` of a failed read (see the module's notes)."""
        if subscribed:
            return True
        failed = self._read_failed_at
        return failed is not None and self.clock() - failed < self.distrust_retry_s

    def read_failed(self) -> None:
        """A read of Redis behind this cache failed: hits answer alone for a while."""
        self._read_failed_at = self.clock()

    def read_succeeded(self) -> None:
        self._read_failed_at = None

    def put(self, key: str, value: V | None, tag: str, generation: int) -> None:
        """Remember ``value`` unless an invalidation came after ``generation`` was read."""
        if generation != self.generation:
            return
        self._remove(key)
        ttl = self.ttl_s if value is not None else self.negative_ttl_s
        self._entries[key] = _Entry(value, tag, self.clock() + ttl)
        if tag:
            self._by_tag.setdefault(tag, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._remove(next(iter(self._entries)))

    def drop(self, tag: str) -> None:
        """Forget every entry of ``tag`` (a key id, ``tenant:<name>``)."""
        self.generation += 1
        for key in self._by_tag.pop(tag, set()):
            self._entries.pop(key, None)

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._by_tag.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.tag:
            keys = self._by_tag.get(entry.tag)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_tag[entry.tag]

"""The in-process cache (time limits, drops by tag, reads racing a drop) and
the one rule for changing limits (None keeps, 0 clears)."""

from __future__ import annotations

import pytest

from gateway.auth.cache import LocalCache
from gateway.auth.types import Limits, merge_limit, merge_limits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_positive_after_ttl_negative_sooner() -> None:
    clock = Clock()
    cache: LocalCache[str] = LocalCache(ttl_s=30, negative_ttl_s=1, clock=clock)
    cache.put("h1", "record", "key_1", cache.generation)
    cache.put("h2", None, "", cache.generation)
    assert cache.get("h1") == (True, "record") and cache.get("h2") == (True, None)
    clock.now += 1.0
    assert cache.get("h1") == (True, "record") and cache.get("h2") == (False, None)
    clock.now += 29.0
    assert cache.get("h1") == (False, None) and len(cache) == 0


def test_a_drop_by_tag_and_a_clear() -> None:
    cache: LocalCache[str] = LocalCache(ttl_s=30)
    cache.put("h1", "a", "key_1", cache.generation)
    cache.put("h2", "b", "key_2", cache.generation)
    cache.drop("key_1")
    assert cache.get("h1") == (False, None) and cache.get("h2") == (True, "b")
    cache.drop("key_unknown")
    cache.clear()
    assert len(cache) == 0


def test_a_read_that_started_before_a_drop_is_not_cached() -> None:
    cache: LocalCache[str] = LocalCache(ttl_s=30)
    seen = cache.generation  # a lookup starts reading Redis ...
    cache.drop("key_1")  # ... the key is revoked meanwhile ...
    cache.put("h1", "stale", "key_1", seen)  # ... its old answer is not kept
    assert cache.get("h1") == (False, None)


def test_the_cache_is_bounded() -> None:
    cache: LocalCache[str] = LocalCache(ttl_s=30, max_entries=3)
    for i in range(5):
        cache.put(f"h{i}", None, "", cache.generation)
    assert len(cache) == 3 and cache.get("h0") == (False, None)
    assert cache.get("h4") == (True, None)


def test_a_limit_change_keeps_clears_or_replaces() -> None:
    assert merge_limit("rpm", 5, None) == 5
    assert merge_limit("rpm", 5, 0) is None
    assert merge_limit("rpm", None, 7) == 7
    assert merge_limits(Limits(rpm=1, tpm=2, concurrency=3), Limits(tpm=0, concurrency=9)) \
        == Limits(rpm=1, tpm=None, concurrency=9)
    with pytest.raises(ValueError, match="rpm"):
        merge_limit("rpm", 5, -1)


def test_hits_are_trusted_only_while_subscribed_or_just_after_a_failed_read() -> None:
    clock = Clock()
    cache: LocalCache[str] = LocalCache(ttl_s=30, clock=clock, distrust_retry_s=1.0)
    assert cache.trusted(subscribed=True)
    assert not cache.trusted(subscribed=False)  # Redis may answer: read it first
    cache.read_failed()
    assert cache.trusted(subscribed=False)  # it did not: the cache answers alone ...
    clock.now += 1.0
    assert not cache.trusted(subscribed=False)  # ... for a second, then Redis is tried again
    cache.read_failed()
    cache.read_succeeded()
    assert not cache.trusted(subscribed=False)

"""Ratings counted into the ledger's rows: a request's latest rating once, per
tenant, model and deployment by day; replays after a crash change nothing."""

from __future__ import annotations

from typing import Any

from workers.usage.ratings import RatingCounts, RatingKey, Ratings
from workers.usage.rows import DAY_MS

NOW = 1_790_000_000_000
DAY = NOW - NOW % DAY_MS


def rating(rid: str, score: float, *, model: str = "m", answered_by: str = "m",
           tenant: str = "acme", ts_ms: int = NOW) -> dict[str, Any]:
    return {"request_id": rid, "tenant": tenant, "key_id": "k", "score": score, "labels": [],
            "comment": "", "model": model, "answered_by": answered_by, "latency_ms": 5,
            "ts_ms": ts_ms}


def counts(ratings: Ratings, dim: str, ident: str = "", day: int = DAY,
           tenant: str = "acme") -> RatingCounts:
    row = ratings.table.get(RatingKey(day, tenant, dim, ident).text())  # type: ignore[arg-type]
    return RatingCounts() if row is None else RatingCounts.from_value(row)


def fresh() -> Ratings:
    return Ratings({}, lambda: NOW)


def test_ratings_count_per_tenant_model_and_deployment() -> None:
    r = fresh()
    assert r.count(rating("a", 1.0, answered_by="m-canary"), 0, 0)
    assert r.count(rating("b", -0.5), 0, 1)
    assert counts(r, "tenant") == RatingCounts(2, 0.5)
    assert counts(r, "model", "m") == RatingCounts(2, 0.5)
    assert counts(r, "deployment", "m-canary") == RatingCounts(1, 1.0)
    assert counts(r, "deployment", "m").mean == -0.5
    assert r.take_dirty() and not r.take_dirty()


def test_rating_again_moves_the_request_s_rating_not_adds_one() -> None:
    r = fresh()
    r.count(rating("a", -1.0), 0, 0)
    r.count(rating("a", 1.0, ts_ms=NOW + DAY_MS), 0, 1)  # the next day, better
    assert counts(r, "tenant") == RatingCounts(0, 0.0)
    assert counts(r, "tenant", day=DAY + DAY_MS) == RatingCounts(1, 1.0)
    r.count(rating("a", 0.5, ts_ms=NOW + DAY_MS), 0, 2)  # same day and rows: in place
    assert counts(r, "tenant", day=DAY + DAY_MS) == RatingCounts(1, 0.5)
    assert counts(r, "model", "m", day=DAY + DAY_MS) == RatingCounts(1, 0.5)


class Changelog(dict[str, Any]):
    """A table that records its writes in order, as its changelog partition does."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, Any]] = []

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.writes.append((key, value))

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.writes.append((key, None))


def restored(writes: list[tuple[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for key, value in writes:
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    return table


def test_a_replay_after_a_crash_changes_nothing_whatever_survived() -> None:
    """A SIGKILL keeps a prefix of the changelog's writes, cut anywhere, even
    between a rating's rows and its latest; the events past the commit are
    read again (all of them here, the commit at the start). Each cut ends with
    the same rows as a run that never crashed. With the latest ratings in a
    table of their own (a changelog of its own, sent independently), a latest
    rating could outlive its rows, and the replay passed over the lost counts."""
    events = [rating("a", -1.0), rating("b", 1.0), rating("a", 0.5),
              rating("b", -0.5, answered_by="m-canary"), rating("c", 1.0)]
    table = Changelog()
    whole = Ratings(table, lambda: NOW)
    for offset, event in enumerate(events):
        whole.count(event, 0, offset)
    for cut in range(len(table.writes) + 1):
        survived = restored(table.writes[:cut])
        replayed = Ratings(survived, lambda: NOW)
        for offset, event in enumerate(events):
            replayed.count(event, 0, offset)
        assert survived == dict(table), f"cut after {cut} writes"
        assert not replayed.count(events[2], 0, 2)  # counted: passed over


def test_old_ratings_are_swept_and_too_old_ones_not_counted() -> None:
    r = fresh()
    r.count(rating("a", 1.0), 0, 0)
    assert not r.count(rating("b", 1.0, ts_ms=NOW - 401 * DAY_MS), 0, 1)
    later = Ratings(r.table, lambda: NOW + 401 * DAY_MS)
    assert later.sweep() == 4  # three rows and the request's latest rating
    assert not r.table

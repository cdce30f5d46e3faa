"""The ledger's counting rules on plain dicts (the accounting app runs them on
Faust tables, which are mutable mappings too): rows, buckets, each request
counted once, replays after a crash, retention."""

from __future__ import annotations

import datetime as dt
from typing import Any

from workers.usage.buckets import (
    DAY_MS,
    MINUTE_MS,
    bucket_start,
    day_label,
    expires_at,
    month_label,
    next_bucket,
)
from workers.usage.counting import SEEN_KEEP_MS, Counter
from workers.usage.layout import decode_counts, encode_counts
from workers.usage.rows import Counts, RowKey, rows_of

T0 = int(dt.datetime(2026, 11, 30, 23, 59, 30, tzinfo=dt.UTC).timestamp() * 1000)


def record(rid: str, *, tenant: str = "acme", key_id: str = "k1", model: str = "m1",
           status: str = "completed", prompt: int = 10, completion: int = 5,
           at: int = T0) -> dict[str, Any]:
    return {"request_id": rid, "tenant": tenant, "key_id": key_id, "model": model,
            "kind": "chat", "status": status, "prompt_tokens": prompt,
            "completion_tokens": completion, "entered_ms": at - 500, "finished_ms": at}


class Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def counts(totals: dict[str, Any], key: RowKey) -> Counts:
    return Counts.from_value(totals[key.text()])


def test_buckets_are_utc_minutes_days_and_months() -> None:
    assert bucket_start(T0, "minute") == T0 - 30_000
    day = bucket_start(T0, "day")
    assert day_label(day) == "2026-11-30" and T0 - day == DAY_MS - 30_000
    month = bucket_start(T0, "month")
    assert dt.datetime.fromtimestamp(month / 1000, tz=dt.UTC) == dt.datetime(
        2026, 11, 1, tzinfo=dt.UTC)
    assert month_label(next_bucket(month, "month")) == "2026-12"
    december = bucket_start(int(dt.datetime(2026, 12, 31, tzinfo=dt.UTC).timestamp() * 1000),
                            "month")
    assert month_label(next_bucket(december, "month")) == "2027-01"
    assert next_bucket(day, "day") - day == DAY_MS
    assert expires_at(bucket_start(T0, "minute"), "minute") - bucket_start(T0, "minute") \
        == 2 * DAY_MS


def test_a_record_counts_in_three_dimensions_by_minute_and_day_and_the_tenants_month(
        ) -> None:
    keys = rows_of(record("r1"))
    assert {(k.by, k.dim, k.ident) for k in keys} == {
        ("minute", "tenant", ""), ("minute", "key", "k1"), ("minute", "model", "m1"),
        ("day", "tenant", ""), ("day", "key", "k1"), ("day", "model", "m1"),
        ("month", "tenant", "")}
    assert all(k.tenant == "acme" for k in keys)
    for key in keys:
        assert RowKey.parse(key.text()) == key


def test_row_keys_survive_any_characters_in_names() -> None:
    key = RowKey("day", "model", T0, 'te:n"ant', "org/model:7b|x")
    assert RowKey.parse(key.text()) == key
    assert decode_counts(encode_counts(Counts(1, 2, 3, 4))) == Counts(1, 2, 3, 4)


def test_counts_add_up_and_a_repeated_request_id_counts_once() -> None:
    seen: dict[str, Any] = {}
    totals: dict[str, Any] = {}
    counter = Counter(seen, totals, Clock(T0))
    assert counter.count(record("r1"), 0, 10)
    assert counter.count(record("r2", status="error", completion=0, model="m2"), 0, 11)
    assert counter.count(record("r3", key_id="k2", prompt=7, completion=3), 0, 12)
    # postprocess wrote r1 again after a crash: another offset, same request
    assert not counter.count(record("r1"), 0, 13)
    day = bucket_start(T0, "day")
    assert counts(totals, RowKey("day", "tenant", day, "acme")) == Counts(3, 1, 27, 8)
    assert counts(totals, RowKey("day", "key", day, "acme", "k1")) == Counts(2, 1, 20, 5)
    assert counts(totals, RowKey("day", "key", day, "acme", "k2")) == Counts(1, 0, 7, 3)
    assert counts(totals, RowKey("day", "model", day, "acme", "m2")) == Counts(1, 1, 10, 0)
    month = RowKey("month", "tenant", bucket_start(T0, "month"), "acme")
    assert counts(totals, month).total_tokens == 35
    assert counter.take_dirty() == set(totals)  # every row changed: all to mirror
    assert counter.take_dirty() == set()


def test_a_replay_after_a_crash_completes_what_the_changelog_lost_and_no_more() -> None:
    """The app counted offsets 5 and 6, but only some of offset 6's writes reached
    the changelog before a SIGKILL; it replays both from the last commit."""
    first_seen: dict[str, Any] = {}
    first_totals: dict[str, Any] = {}
    Counter(first_seen, first_totals, Clock(T0)).count(record("a"), 1, 5)
    before_b = dict(first_totals)
    Counter(first_seen, first_totals, Clock(T0)).count(record("b", completion=1), 1, 6)
    # what survived: seen has only a; of b's rows, the minute ones only
    seen = {"a": first_seen["a"]}
    totals = {t: (v if RowKey.parse(t).by == "minute" else before_b[t])
              for t, v in first_totals.items()}
    counter = Counter(seen, totals, Clock(T0))
    assert counter.count(record("a"), 1, 5)  # its own mark: a replay, not a repeat
    assert counter.count(record("b", completion=1), 1, 6)
    for text, value in totals.items():
        assert Counts.from_value(value) == Counts.from_value(first_totals[text]), text
    assert counts(totals, RowKey("day", "tenant", bucket_start(T0, "day"), "acme")) == \
        Counts(2, 0, 20, 6)
    # and a later copy of b from postprocess is still a repeat
    assert not counter.count(record("b", completion=1), 1, 9)


def test_rows_of_another_partition_do_not_hide_an_event() -> None:
    totals: dict[str, Any] = {}
    counter = Counter({}, totals, Clock(T0))
    counter.count(record("x"), 2, 100)
    # the topic grew partitions: the tenant now lands elsewhere, at a lower offset
    assert counter.count(record("y"), 3, 4)
    assert counts(totals, RowKey("day", "tenant", bucket_start(T0, "day"), "acme")).requests \
        == 2


def test_sweep_drops_old_minutes_and_request_ids_of_its_partition_only() -> None:
    seen: dict[str, Any] = {}
    totals: dict[str, Any] = {}
    clock = Clock(T0)
    counter = Counter(seen, totals, clock)
    counter.count(record("old"), 0, 1)
    counter.count(record("other", tenant="zeta"), 1, 1)
    clock.now = T0 + 2 * DAY_MS + MINUTE_MS
    assert counter.sweep(0) == 1 + 3  # the request id and the three minute rows
    assert "old" not in seen and "other" in seen
    assert {RowKey.parse(t).by for t, v in totals.items() if v["p"] == 0} == {"day", "month"}
    assert len([t for t, v in totals.items() if v["p"] == 1]) == 7
    # a late copy of a swept request is no longer known: retention is the bound
    assert clock.now - T0 > SEEN_KEEP_MS


def test_a_late_event_skips_buckets_already_dropped() -> None:
    totals: dict[str, Any] = {}
    counter = Counter({}, totals, Clock(T0 + 3 * DAY_MS))
    assert counter.count(record("late"), 0, 1)
    assert {RowKey.parse(t).by for t in totals} == {"day", "month"}

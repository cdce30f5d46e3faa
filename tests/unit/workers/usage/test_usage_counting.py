"""The ledger's counting rules on plain dicts (the accounting app runs them on
a Faust table, which is a mutable mapping too): rows, buckets, each request
counted once within the window of recent request ids, replays after a
crash, retention."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

from workers.usage.counting import Counter
from workers.usage.mirror import decode_counts, encode_counts
from workers.usage.rows import (
    DAY_MS,
    MINUTE_MS,
    Counts,
    RowKey,
    bucket_start,
    day_label,
    expires_at,
    month_label,
    next_bucket,
    rows_of,
    ttft_bucket,
)

T0 = int(dt.datetime(2026, 11, 30, 23, 59, 30, tzinfo=dt.UTC).timestamp() * 1000)


def record(rid: str, *, tenant: str = "acme", key_id: str = "k1", model: str = "m1",
           status: str = "completed", prompt: int = 10, completion: int = 5,
           at: int = T0) -> dict[str, Any]:
    return {"request_id": rid, "tenant": tenant, "key_id": key_id, "model": model,
            "kind": "chat", "status": status, "prompt_tokens": prompt,
            "completion_tokens": completion, "entered_ms": at - 500, "finished_ms": at,
            "first_token_ms": at - 250}


class Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def counts(totals: dict[str, Any], key: RowKey) -> Counts:
    return Counts.from_value(totals[key.text()])


def started(counter: Counter, partition: int, offset: int) -> Counter:
    """``counter`` with the window of ``partition`` read back at ``offset`` from a
    log that holds nothing before it."""
    counter.load_window(partition, offset, [])
    return counter


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
    keys = rows_of(record("r1"), 3)
    assert {(k.by, k.dim, k.ident) for k in keys} == {
        ("minute", "tenant", ""), ("minute", "key", "k1"), ("minute", "model", "m1"),
        ("day", "tenant", ""), ("day", "key", "k1"), ("day", "model", "m1"),
        ("month", "tenant", ""), ("minute", "models", "m1")}
    # and its model's minute over every tenant: a row of its partition, no tenant's
    models = [k for k in keys if k.dim == "models"]
    assert [(k.tenant, k.partition) for k in models] == [("", 3)]
    assert all(k.tenant == "acme" and k.partition is None for k in keys if k.dim != "models")
    for key in keys:
        assert RowKey.parse(key.text()) == key


def test_row_keys_survive_any_characters_in_names() -> None:
    key = RowKey("day", "model", T0, 'te:n"ant', "org/model:7b|x")
    assert RowKey.parse(key.text()) == key
    assert decode_counts(encode_counts(Counts(1, 2, 3, 4))) == Counts(1, 2, 3, 4)


def test_counts_add_up_and_a_repeated_request_id_counts_once() -> None:
    totals: dict[str, Any] = {}
    counter = started(Counter(totals, Clock(T0)), 0, 10)
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
    m1 = counts(totals, RowKey("minute", "models", bucket_start(T0, "minute"), "", "m1", 0))
    assert (m1.requests, m1.errors, m1.prompt_tokens, m1.completion_tokens) == (2, 0, 17, 8)
    assert m1.ttft[ttft_bucket(250)] == 2 and sum(m1.ttft) == 2
    assert counter.take_dirty() == set(totals)  # every row changed: all to mirror
    assert counter.take_dirty() == set()


def test_a_replay_after_a_crash_completes_what_the_changelog_lost_and_no_more() -> None:
    """The app counted offsets 5 and 6, but only some of offset 6's writes reached
    the changelog before a SIGKILL; it replays both from the last commit."""
    log = [(5, "a"), (6, "b")]
    first_totals: dict[str, Any] = {}
    first = started(Counter(first_totals, Clock(T0)), 1, 5)
    first.count(record("a"), 1, 5)
    before_b = dict(first_totals)
    first.count(record("b", completion=1), 1, 6)
    # what survived: of b's rows, the minute ones only
    totals = {t: (v if RowKey.parse(t).by == "minute" else before_b[t])
              for t, v in first_totals.items()}
    counter = Counter(totals, Clock(T0))
    assert counter.needs_window(1, 5)
    counter.load_window(1, 5, [e for e in log if e[0] < 5])  # the ids before the commit
    assert counter.count(record("a"), 1, 5)  # its own event again: a replay, not a repeat
    assert counter.count(record("b", completion=1), 1, 6)
    for text, value in totals.items():
        assert Counts.from_value(value) == Counts.from_value(first_totals[text]), text
    assert counts(totals, RowKey("day", "tenant", bucket_start(T0, "day"), "acme")) == \
        Counts(2, 0, 20, 6)
    # and a later copy of b from postprocess is still a repeat
    assert not counter.count(record("b", completion=1), 1, 7)


def test_a_repeat_within_the_window_is_dropped_and_one_beyond_it_counted() -> None:
    """The bound, exactly: a copy ``window`` offsets after a copy is dropped, one
    ``window + 1`` offsets after it is a new request as far as the ledger knows."""
    totals: dict[str, Any] = {}
    counter = started(Counter(totals, Clock(T0), window=3), 0, 0)
    ids = ["a", "b", "c", "a", "d", "e", "f", "a"]
    assert [counter.count(record(rid), 0, at) for at, rid in enumerate(ids)] == [
        True, True, True, False, True, True, True, True]
    assert counts(totals, RowKey("day", "tenant", bucket_start(T0, "day"), "acme")).requests \
        == 7


def remembered(counter: Counter) -> int:
    """How many request ids the windows hold, all partitions together."""
    return sum(len(seen) for seen in counter.windows.values())


def test_memory_holds_the_window_whatever_the_traffic() -> None:
    """Request ids are kept for the last ``window`` offsets of each partition,
    not for days: 5,000 requests a partition leave 1,000 ids a partition."""
    counter = started(started(Counter({}, Clock(T0), window=1000), 0, 0), 1, 0)
    for i in range(5000):
        counter.count(record(f"r{i}"), 0, i)
        counter.count(record(f"z{i}", tenant="zeta"), 1, i)
    assert remembered(counter) == 2000
    assert "r3999" not in counter.windows[0] and "r4000" in counter.windows[0]
    counter.forget(1)  # the partition went to another member
    assert remembered(counter) == 1000 and counter.needs_window(1, 5000)


def test_a_value_that_is_no_usage_record_moves_the_window_on() -> None:
    counter = started(Counter({}, Clock(T0), window=2), 0, 0)
    assert counter.count(record("a"), 0, 0)
    counter.skip(0, 1)  # a poison value: dead-lettered, not counted
    assert not counter.needs_window(0, 2)  # no reading back for it
    assert counter.count(record("b"), 0, 2)
    assert counter.count(record("a"), 0, 3)  # offsets 1 and 2 hold nothing and b
    assert counter.needs_window(0, 7) and counter.needs_window(1, 0)


def _usage_log(size: int, reach: int, seed: int) -> list[str | None]:
    """Request ids of one partition: new ones, repeats up to ``reach`` offsets
    back, and values that are no UsageRecord (None)."""
    rng = random.Random(seed)
    log: list[str | None] = []
    for at in range(size):
        roll = rng.random()
        if roll < 0.05:
            log.append(None)
        elif roll < 0.4 and at:
            log.append(log[rng.randrange(max(0, at - reach), at)] or f"n{at}")
        else:
            log.append(f"r{at}")
    return log


def test_a_window_read_back_from_the_log_judges_every_later_event_as_the_first_run() -> None:
    """A restart or a rebalance at any offset: the window read back from the log
    gives each later event the verdict the run that never stopped gave it,
    repeats on both sides of the window's edge and poison values included."""
    log = _usage_log(400, reach=30, seed=7)

    def run(counter: Counter, start: int) -> dict[int, bool]:
        verdicts: dict[int, bool] = {}
        for at in range(start, len(log)):
            rid = log[at]
            if rid is None:
                counter.skip(0, at)
            else:
                verdicts[at] = counter.count(record(rid), 0, at)
        return verdicts

    whole = run(started(Counter({}, Clock(T0), window=20), 0, 0), 0)
    repeats = [at for at, rid in enumerate(log) if rid is not None and rid in log[:at]]
    assert any(whole[at] for at in repeats) and not all(whole[at] for at in repeats)
    for restart in range(1, len(log), 7):
        counter = Counter({}, Clock(T0), window=20)
        assert counter.needs_window(0, restart)
        counter.load_window(0, restart, [(at, log[at]) for at in range(restart)])
        assert run(counter, restart) == {at: v for at, v in whole.items() if at >= restart}


def test_rows_of_another_partition_do_not_hide_an_event() -> None:
    totals: dict[str, Any] = {}
    counter = started(Counter(totals, Clock(T0)), 2, 100)
    counter.count(record("x"), 2, 100)
    # the topic grew partitions: the tenant now lands elsewhere, at a lower offset
    started(counter, 3, 4)
    assert counter.count(record("y"), 3, 4)
    assert counts(totals, RowKey("day", "tenant", bucket_start(T0, "day"), "acme")).requests \
        == 2


def test_sweep_drops_old_minutes_of_its_partition_only() -> None:
    totals: dict[str, Any] = {}
    clock = Clock(T0)
    counter = started(started(Counter(totals, clock), 0, 1), 1, 1)
    counter.count(record("old"), 0, 1)
    counter.count(record("other", tenant="zeta"), 1, 1)
    clock.now = T0 + 2 * DAY_MS + MINUTE_MS
    assert counter.sweep(0) == 4  # the three minute rows and the model-wide one
    assert {RowKey.parse(t).by for t, v in totals.items() if v["p"] == 0} == {"day", "month"}
    assert len([t for t, v in totals.items() if v["p"] == 1]) == 8


def test_a_late_event_skips_buckets_already_dropped() -> None:
    totals: dict[str, Any] = {}
    counter = started(Counter(totals, Clock(T0 + 3 * DAY_MS)), 0, 1)
    assert counter.count(record("late"), 0, 1)
    assert {RowKey.parse(t).by for t in totals} == {"day", "month"}

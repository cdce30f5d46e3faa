"""The model-wide minute rows' time to first token: the log-scaled histogram,
its percentiles, and how a row holding one is stored and read back."""

from __future__ import annotations

import random

import pytest

from workers.usage.mirror import UsageKeys, decode_counts, encode_counts
from workers.usage.rows import (
    TTFT_BOUNDS_MS,
    TTFT_BUCKETS,
    TTFT_NONE,
    Counts,
    RowKey,
    ttft_bucket,
    ttft_histogram,
    ttft_percentile,
)


def histogram(times: list[int | None]) -> tuple[int, ...]:
    counts = [0] * TTFT_BUCKETS
    for ttft in times:
        counts[ttft_bucket(ttft)] += 1
    return tuple(counts)


def test_buckets_double_from_ten_ms_to_about_ten_minutes_plus_one_for_none() -> None:
    assert TTFT_BOUNDS_MS[0] == 10 and TTFT_BOUNDS_MS[-1] == 655_360
    assert all(b == 2 * a for a, b in zip(TTFT_BOUNDS_MS, TTFT_BOUNDS_MS[1:], strict=False))
    assert ttft_bucket(0) == 0 and ttft_bucket(9) == 0
    assert ttft_bucket(10) == 1 and ttft_bucket(19) == 1 and ttft_bucket(20) == 2
    assert ttft_bucket(655_359) == len(TTFT_BOUNDS_MS) - 1
    assert ttft_bucket(3_600_000) == len(TTFT_BOUNDS_MS)
    assert ttft_bucket(None) == TTFT_NONE == TTFT_BUCKETS - 1


def test_a_records_histogram_is_its_time_from_entering_to_the_first_token() -> None:
    base = {"entered_ms": 1_000}
    assert ttft_histogram({**base, "first_token_ms": 1_300})[ttft_bucket(300)] == 1
    assert ttft_histogram({**base, "first_token_ms": None})[TTFT_NONE] == 1
    assert ttft_histogram(base)[TTFT_NONE] == 1  # a record written before the field
    # a clock that went back: counted as no wait, not as a negative one
    assert ttft_histogram({**base, "first_token_ms": 900})[0] == 1
    assert sum(ttft_histogram({**base, "first_token_ms": 1_300})) == 1


def test_percentiles_stay_within_the_bucket_of_the_true_value() -> None:
    rng = random.Random(7)
    times = [int(rng.lognormvariate(5.5, 1.0)) for _ in range(5_000)]
    hist = histogram([*times, None, None])
    for q in (0.5, 0.9, 0.99):
        true = sorted(times)[int(q * len(times)) - 1]
        estimate = ttft_percentile(hist, q)
        assert estimate is not None
        # within a factor of two: the width of one bucket
        assert true / 2 <= estimate <= true * 2, (q, true, estimate)


def test_percentiles_of_one_bucket_and_the_edges() -> None:
    assert ttft_percentile(histogram([None, None]), 0.5) is None
    assert ttft_percentile(histogram([]), 0.99) is None
    one = ttft_percentile(histogram([300]), 0.5)
    assert one is not None and 160 <= one <= 320  # within [160, 320), its bucket
    assert ttft_percentile(histogram([5, 5]), 1.0) == 10.0
    assert ttft_percentile(histogram([10 ** 7]), 0.5) == float(TTFT_BOUNDS_MS[-1])
    low = ttft_percentile(histogram([15] * 99 + [40_000]), 0.5)
    high = ttft_percentile(histogram([15] * 99 + [40_000]), 0.999)
    assert low is not None and high is not None and low < 20 and high >= 32_768
    with pytest.raises(ValueError, match="quantile"):
        ttft_percentile(histogram([1]), 0)
    with pytest.raises(ValueError, match="buckets"):
        ttft_percentile((1, 2), 0.5)


def test_a_models_row_keeps_its_histogram_through_the_table_and_redis() -> None:
    ttft = histogram([120, 700, None])
    counts = Counts(3, 1, 30, 12, ttft)
    assert Counts.from_value(counts.value(2, 41)) == counts
    assert decode_counts(encode_counts(counts)) == counts
    # the other rows are as they were: four counts, no histogram
    plain = Counts(3, 1, 30, 12)
    assert encode_counts(plain) == "3 1 30 12" and "h" not in plain.value(0, 0)
    assert counts.plus(Counts(1, 0, 1, 1, histogram([120]))).ttft[ttft_bucket(120)] == 2
    assert plain.plus(counts).ttft == ttft


def test_a_models_row_key_cannot_be_a_tenants() -> None:
    key = RowKey("minute", "models", 60_000, "", "org/model:7b", 5)
    assert RowKey.parse(key.text()) == key
    assert key.text() != RowKey("minute", "model", 60_000, "", "org/model:7b").text()
    keys = UsageKeys("cv")
    # its own hash, beside no tenant's (a tenant's keys are "cv:usage:<tenant>:...")
    assert keys.models(60_000) == "cv:usage-models:by-minute:60000"
    field = keys.model_field(5, "org/model:7b")
    assert keys.parse_model_field(field) == (5, "org/model:7b")

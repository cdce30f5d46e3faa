"""bench.hops's split of each hop into the layer's own work and the transit."""

from __future__ import annotations

import pytest

from bench.hops import HOPS, OUTPUTS, _output_of, split, split_table


def test_a_hop_splits_at_its_output_records_create_time() -> None:
    # stamps in µs; each layer takes the event 2 ms after the last and sends its
    # output 0.5 ms after taking it (CreateTime whole ms, truncated)
    stamps = {"r1": {hop: 1_000_000 + i * 2_000 for i, hop in enumerate(HOPS)}}
    sent_at = {"r1": {out: 1_000 + i * 2 for i, out in enumerate(OUTPUTS)}}
    parts = split(stamps, sent_at)
    own, transit = parts["gateway"]
    assert own == [pytest.approx(0.5)] and transit == [pytest.approx(1.5)]
    assert parts["postprocess"][1] == []  # the last layer's transit is the client's
    table = split_table(parts)
    assert "route" in table and "0.50" in table and "1.50" in table


def test_requests_missing_a_stamp_or_an_output_are_left_out() -> None:
    stamps = {"r1": {hop: 0 for hop in HOPS}, "r2": {hop: 0 for hop in HOPS[:-1]}}
    sent_at = {"r1": {out: 0 for out in OUTPUTS[:-1]}, "r2": {out: 0 for out in OUTPUTS}}
    assert all(own == [] for own, _ in split(stamps, sent_at).values())


def test_every_pool_topic_counts_as_infers_output() -> None:
    assert _output_of("p", "p.infer.cpu") == "infer."
    assert _output_of("p", "p.tokens") == "tokens"

"""Request ids: unique, and carrying the moment they were made, so that the log
is searched for a request at that moment (gateway/resume.py, whose tests check
the search)."""

from __future__ import annotations

import re

from topics.envelope import new_request_id, now_ms, request_time_ms


def test_a_request_id_is_32_hex_digits_starting_with_its_time() -> None:
    before = now_ms()
    rid = new_request_id()
    after = now_ms()
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    made = request_time_ms(rid)
    assert made is not None and before <= made <= after
    assert len({new_request_id() for _ in range(10_000)}) == 10_000


def test_ids_of_another_shape_have_no_time() -> None:
    assert request_time_ms("short") is None
    assert request_time_ms("z" * 32) is None

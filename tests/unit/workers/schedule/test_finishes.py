"""Schedule's finish follower decodes only the tokens records that end a
generation it waits for (workers/schedule/outstanding.py), by their headers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from conveyor.settings import load_settings
from tests.support.factories import chunk
from topics.reader import ended_ids_header, request_ids_header
from workers.schedule.outstanding import FinishFollower


def record(chunks: list[Any], ended: bool = True) -> Any:
    headers = [request_ids_header(c["envelope"]["request_id"] for c in chunks)]
    if ended:
        headers.append(ended_ids_header(c["envelope"]["request_id"] for c in chunks
                                        if c["finish_reason"] is not None))
    return SimpleNamespace(key=None, headers=headers)


def test_only_records_ending_a_wanted_generation_are_decoded() -> None:
    follower = FinishFollower(load_settings(), {"a", "b"}.__contains__, lambda *_: None)
    mid = [chunk("a", 3, "x"), chunk("b", 1, "y"), chunk("c", 0, "z", finish="stop")]
    assert not follower.wants(record(mid))  # only c ends, and c is not waited for
    assert follower.wants(record([*mid, chunk("b", 2, "", finish="stop")]))
    # a record that does not say what it ends (a chunk written alone) is read
    assert follower.wants(record(mid, ended=False))
    assert not follower.wants(SimpleNamespace(key=b"c", headers=[]))
    assert follower.wants(SimpleNamespace(key=b"a", headers=[]))

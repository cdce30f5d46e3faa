"""The window of recent request ids of one usage partition (workers/usage/counting.py)."""

from __future__ import annotations

import pytest

from workers.usage.counting import SeenWindow


def test_the_window_holds_the_ids_of_its_last_offsets() -> None:
    seen = SeenWindow(3, next_offset=10)
    for at, rid in enumerate(["a", "b", "c", "d"], start=10):
        seen.add(at, rid)
    assert seen.next_offset == 14
    assert "a" not in seen and all(rid in seen for rid in "bcd") and len(seen) == 3


def test_an_id_stays_while_any_of_its_copies_is_in_the_window() -> None:
    seen = SeenWindow(3, next_offset=0)
    for at, rid in enumerate(["a", "b", "a", "c"]):
        seen.add(at, rid)
    assert "a" in seen  # the copy at 2 is still there
    seen.add(4, "d")
    seen.add(5, "e")
    assert "a" not in seen and len(seen) == 3


def test_offsets_without_a_usage_record_take_their_place_in_the_window() -> None:
    seen = SeenWindow(3, next_offset=0)
    seen.add(0, "a")
    seen.add(1, None)
    seen.add(3, "b")  # nothing at 2
    assert "a" not in seen and "b" in seen and seen.next_offset == 4
    seen.add(100, "c")  # a gap longer than the window leaves only what follows it
    assert len(seen) == 1 and "c" in seen


def test_the_window_only_moves_forward() -> None:
    seen = SeenWindow(3, next_offset=5)
    with pytest.raises(ValueError):
        seen.add(4, "a")
    with pytest.raises(ValueError):
        SeenWindow(0, next_offset=0)

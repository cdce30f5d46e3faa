"""Outstanding: the tasks schedule sent and has not seen finish."""

from __future__ import annotations

from workers.schedule.outstanding import Outstanding


def test_counts_by_worker_and_pool_and_priority() -> None:
    book = Outstanding(clock=lambda: 1000)
    book.add("i1", "w1", "cpu", 0, 9_999)
    book.add("b1", "w1", "cpu", 2, 9_999)
    book.add("g1", "w2", "cpu", 1, 9_999)
    assert (book.at("w1"), book.at("w2"), book.low("cpu"), book.interactive("cpu")) == (2, 1, 2, 1)
    assert book.forget("b1") is not None and book.forget("b1") is None
    assert (book.at("w1"), book.low("cpu")) == (1, 1)
    book.add("i1", "w2", "cpu", 0, 9_999)  # sent again: counted once, where it went last
    assert (book.at("w1"), book.at("w2"), book.interactive("cpu")) == (0, 2, 1)


def test_a_beat_with_room_drops_entries_it_proves_finished() -> None:
    clock = [0]
    book = Outstanding(clock=lambda: clock[0])
    for i in range(3):
        clock[0] = 1000 + i
        book.add(f"r{i}", "w1", "cpu", 2, 99_999)
    clock[0] = 9000
    book.add("new", "w1", "cpu", 2, 99_999)
    # a full worker proves nothing: the tasks may be waiting in its partition
    assert book.reconcile("w1", running=4, capacity=4, beat_ms=9000, slack_ms=2000) == []
    # with room it runs one: of the three sent long before, the two oldest are gone
    assert book.reconcile("w1", running=1, capacity=4, beat_ms=9000, slack_ms=2000) == [
        "r0", "r1"]
    assert "r2" in book and "new" in book and book.at("w1") == 2


def test_entries_past_their_deadline_expire() -> None:
    clock = [0]
    book = Outstanding(clock=lambda: clock[0])
    book.add("r1", "w1", "cpu", 2, 1000)
    book.add("r2", "w1", "cpu", 2, 500_000)
    clock[0] = 200_000
    assert book.expire() == ["r1"]
    assert len(book) == 1

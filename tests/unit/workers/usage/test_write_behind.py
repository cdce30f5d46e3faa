"""The ledger's rows changelogged once a flush (workers/usage/changelog.py),
on a stand-in for the Faust table's two seams: its store and send_changelog."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.usage.changelog import WriteBehind
from workers.usage.counting import Counter

NOW = 1_796_000_000_000


@dataclass
class Table:
    data: dict[str, Any] = field(default_factory=dict)
    sent: list[tuple[int, str, Any]] = field(default_factory=list)

    def send_changelog(self, partition: int, key: str, value: Any,
                       value_serializer: str | None = None) -> None:
        self.sent.append((partition, key, value))


def usage(rid: str) -> dict[str, Any]:
    return {"request_id": rid, "tenant": "acme", "key_id": "k1", "model": "m1", "kind": "chat",
            "status": "completed", "prompt_tokens": 3, "completion_tokens": 4,
            "entered_ms": NOW - 500, "finished_ms": NOW}


def test_a_row_changed_by_many_events_is_sent_once_as_it_ends() -> None:
    table = Table()
    rows = WriteBehind(table)
    rows["a"] = {"p": 1, "o": 5, "n": 1}
    rows["a"] = {"p": 1, "o": 6, "n": 2}
    rows["b"] = {"p": 0, "o": 2, "n": 1}
    assert rows.get("a") == {"p": 1, "o": 6, "n": 2} and table.sent == []
    assert rows.flush() == 2
    assert sorted(table.sent) == [(0, "b", {"p": 0, "o": 2, "n": 1}),
                                  (1, "a", {"p": 1, "o": 6, "n": 2})]
    assert rows.flush() == 0  # nothing changed since


def test_a_deleted_row_sends_a_tombstone_to_its_partition() -> None:
    table = Table(data={"a": {"p": 3, "o": 1}})
    rows = WriteBehind(table)
    del rows["a"]
    rows.flush()
    assert table.sent == [(3, "a", None)] and "a" not in table.data


def test_a_revoked_partition_s_unsent_rows_are_dropped_from_the_store_too() -> None:
    table = Table()
    rows = WriteBehind(table)
    rows["a"] = {"p": 1, "o": 5}
    rows["b"] = {"p": 2, "o": 5}
    assert rows.drop(1) == 1
    rows.flush()
    assert table.sent == [(2, "b", {"p": 2, "o": 5})] and "a" not in table.data


def test_counting_through_it_reads_its_own_writes() -> None:
    """The counter sees the rows it changed before they are sent: a hundred
    events of one tenant make one changelog record a row."""
    table = Table()
    rows = WriteBehind(table)
    counter = Counter(rows, clock=lambda: NOW)
    counter.load_window(0, 0, [])
    for i in range(100):
        assert counter.count(usage(f"r{i}"), 0, i)
    sent = rows.flush()
    assert sent == len(table.data) == len({key for _, key, _ in table.sent})
    assert all(value["o"] == 99 for _, _, value in table.sent)

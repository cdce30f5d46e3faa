"""Ledger rows written to their changelog once a commit, not once an event.

A Faust table writes a changelog record for every assignment, and a usage
event changes seven rows (workers/usage/rows.py), under load the same seven
each event (measured: docs/decisions/0002-faust-on-the-cold-path-only.md).
:class:`WriteBehind` is the mapping the Counter counts into: it changes the
table's store at once and remembers which rows changed; :meth:`WriteBehind.flush`
sends each once, to the changelog partition the row names (its ``p``). The app
calls it as Faust is about to commit (workers/usage/drain.py waits for those
writes), so a committed offset still covers only events whose rows are in
the changelog. When a partition goes to another member its unsent rows are
dropped, from the store too: the new owner reads those events again.

It uses two Faust internals (faust-streaming 0.15.3): the store ``table.data``,
written directly so no changelog record is sent, and
``table.send_changelog(partition, key, value, ...)``; both pinned by
tests/unit/workers/usage/test_faust_patches.py.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

__all__ = ["WriteBehind"]


class WriteBehind(MutableMapping[str, Any]):
    """Rows of a Faust table (``table.data`` is its store), changelogged on
    :meth:`flush`. Each row value carries its partition as ``p``."""

    def __init__(self, table: Any) -> None:
        self.table = table
        # row key -> the partition of its changelog, for the rows changed since
        # the last flush (a deleted row: a tombstone to send)
        self.pending: dict[str, int] = {}

    @property
    def store(self) -> Any:
        return self.table.data

    def __getitem__(self, key: str) -> Any:
        return self.store[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.store.get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self.store[key] = value
        self.pending[key] = value["p"]

    def __delitem__(self, key: str) -> None:
        row = self.store[key]
        del self.store[key]
        self.pending[key] = row["p"]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.store))

    def __len__(self) -> int:
        return len(self.store)

    def flush(self) -> int:
        """Send every changed row (a tombstone for a deleted one) to the
        changelog; how many."""
        pending, self.pending = self.pending, {}
        for key, partition in pending.items():
            row = self.store.get(key)
            if row is None:
                self.table.send_changelog(partition, key, None, value_serializer="raw")
            else:
                self.table.send_changelog(partition, key, row)
        return len(pending)

    def drop(self, partition: int) -> int:
        """Forget the unsent rows of ``partition`` (it went to another member),
        and take them out of the store; how many."""
        gone = [key for key, p in self.pending.items() if p == partition]
        for key in gone:
            del self.pending[key]
            self.store.pop(key, None)
        return len(gone)

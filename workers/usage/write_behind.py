"""Ledger rows written to their changelog once a commit, not once an event.

A Faust table writes a changelog record for every assignment. A usage event
changes seven rows (workers/usage/rows.py), and under load the same seven
rows (one tenant, one key, one model, this minute and this day) change with
every event: ``bench.profile`` counted 7 changelog records a request, the
largest share of what the log stored for one (measured:
docs/decisions/0002-faust-on-the-cold-path-only.md).

:class:`WriteBehind` is the mapping :class:`~workers.usage.counting.Counter`
counts into. It changes the table's store at once (so the next event reads
the new row) and remembers which rows changed; :meth:`WriteBehind.flush`
sends each changed row once, as it is then, to the changelog partition the
row names (its ``p``). The accounting app calls it when Faust is about to
commit (workers/usage/drain.py: the flush runs first, and the drain then
waits for those writes' acknowledgements), so a committed offset still only
covers events whose rows are in the changelog, which is all the counting
rules need (workers/usage/counting.py): after a SIGKILL the events past the
commit are read again, and a row restored without them counts them then.

When a partition goes to another member, its unsent rows are dropped, from
the store too: the new owner reads those events again, and this member must
neither overwrite the owner's rows later nor, if the partition comes back,
trust a row that never reached the changelog (the restore puts the
changelog's version back).

It uses two of the Faust table's internals (faust-streaming 0.15.3): its
store, ``table.data`` (a dict for ``memory://``), written directly so that no
changelog record is sent, where ``Table.__setitem__`` would send one a write;
and ``table.send_changelog(partition, key, value, ...)``, which Faust's own
writes call. Both are pinned by tests/unit/workers/usage/test_faust_patches.py.
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

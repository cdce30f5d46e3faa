"""Counting one UsageRecord into the ledger's tables, exactly once.

- **Postprocess wrote the record twice**: a record whose request id is among
  the :data:`SEEN_WINDOW` offsets before it in its partition is dropped
  (workers/usage/seen.py). The window is kept in memory and read back after
  a restart or a rebalance (:meth:`Counter.needs_window`,
  :meth:`Counter.load_window`).
- **The app replays events** (at-least-once: after a SIGKILL it starts from
  the last commit, and the changelog may already hold some rows' effect of
  later events). Each row stores the position of the last event counted in
  it; an event at or before it in the same partition leaves the row alone.
  A changelog record is a whole row, so every row is consistent with itself
  and the replay completes the rest. A replayed event meets the same window,
  so the two guards never disagree.

:class:`Counter` needs only a mutable mapping: tested on dicts, run on a
Faust table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from workers.usage.buckets import is_expired
from workers.usage.rows import Counts, RowKey, rows_of
from workers.usage.seen import SEEN_WINDOW, SeenWindow

__all__ = ["Counter", "SEEN_WINDOW"]


class Counter:
    """Counts records into ``totals`` (row key text -> row value), dropping a
    request id seen in the ``window`` offsets before it in its partition.
    Remembers which rows changed (``dirty``) for the Redis mirror."""

    def __init__(self, totals: MutableMapping[str, Any], clock: Callable[[], int],
                 window: int = SEEN_WINDOW) -> None:
        self.totals = totals
        self.clock = clock
        self.window = window
        self.windows: dict[int, SeenWindow] = {}
        self.dirty: set[str] = set()

    def needs_window(self, partition: int, offset: int) -> bool:
        """Whether the ids before ``offset`` must be read back first: after a
        start, a rebalance or a replay, when this is not the event right after
        the last one this counter saw in ``partition``."""
        seen = self.windows.get(partition)
        return seen is None or seen.next_offset != offset

    def load_window(self, partition: int, offset: int,
                    before: Iterable[tuple[int, str | None]]) -> None:
        """Set the window of ``partition`` to the ids read back from the log:
        ``(offset, request id or None)`` of the records just before ``offset``,
        in offset order (the last ``window`` of them matter)."""
        seen = SeenWindow(self.window, max(0, offset - self.window))
        for at, request_id in before:
            if offset - self.window <= at < offset:
                seen.add(at, request_id)
        if seen.next_offset < offset:
            seen.add(offset - 1, None)  # nothing was there: the window still ends here
        self.windows[partition] = seen

    def forget(self, partition: int) -> None:
        """``partition`` went to another member: its window is stale from now on."""
        self.windows.pop(partition, None)

    def skip(self, partition: int, offset: int) -> None:
        """The value at ``offset`` was not a UsageRecord: the window moves past it."""
        seen = self.windows.get(partition)
        if seen is not None and seen.next_offset == offset:
            seen.add(offset, None)

    def count(self, record: Any, partition: int, offset: int) -> bool:
        """Count ``record``, read at ``offset`` of ``partition`` (whose window must
        end there: :meth:`needs_window`); False when it was a repeat of a request
        counted before."""
        seen = self.windows[partition]
        if seen.next_offset != offset:
            raise ValueError(f"the window of partition {partition} ends at "
                             f"{seen.next_offset}, not at {offset}: load it first")
        rid = record["request_id"]
        repeat = rid in seen
        seen.add(offset, rid)
        if repeat:
            return False
        now = self.clock()
        add = Counts.of(record)
        for key in rows_of(record):
            if is_expired(key.bucket_ms, key.by, now):
                continue  # a late event for a bucket already dropped
            text = key.text()
            row = self.totals.get(text)
            if row is not None and row["p"] == partition and row["o"] >= offset:
                continue  # counted here before a crash; the app replays it
            before = Counts.from_value(row) if row is not None else Counts()
            self.totals[text] = before.plus(add).value(partition, offset)
            self.dirty.add(text)
        return True

    def sweep(self, partition: int) -> int:
        """Drop the rows of ``partition`` past their retention; returns how many.
        Only the partition of the event in hand may be swept: a Faust table
        writes its changelog in that event's partition."""
        now = self.clock()
        dropped = 0
        for text, row in list(self.totals.items()):
            if row["p"] != partition:
                continue
            key = RowKey.parse(text)
            if is_expired(key.bucket_ms, key.by, now):
                del self.totals[text]
                self.dirty.discard(text)
                dropped += 1
        return dropped

    def take_dirty(self) -> set[str]:
        dirty, self.dirty = self.dirty, set()
        return dirty

"""Counting one UsageRecord into the ledger's tables, exactly once.

Two different repeats reach the accounting app, and each has its guard:

- **Postprocess wrote the record twice** (it rebuilt a request from the log
  after a crash). Both copies carry the same request id and, as the topic is
  keyed by tenant, sit in the same partition. The ``seen`` table remembers
  each request id with the position (partition, offset) of the copy that was
  counted; a copy at another position is dropped. Entries are swept two
  days after they were counted: redeliveries come within minutes.
- **The app itself replays events** (Faust is at-least-once: after a
  SIGKILL it starts again from the last committed offset, and the changelog
  may already hold the effect of events after it, for some rows and not
  others, since each table write is a record of its own). So each row
  stores, with its counts, the position of the last event counted in it;
  an event at or before that position in the same partition has been
  counted there already and leaves the row alone. Each changelog record is
  a whole row, so whatever subset of the writes survived a crash, every row
  is consistent with itself and the replay completes the rest.

The ``seen`` entry is written before the rows: if the crash fell between
them, the replayed event finds its own position in ``seen`` and goes on to
the rows. :class:`Counter` only needs mutable mappings, so the rules are
tested on dicts and run on Faust tables unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from workers.usage.buckets import is_expired
from workers.usage.rows import Counts, RowKey, rows_of

__all__ = ["Counter", "SEEN_KEEP_MS"]

SEEN_KEEP_MS = 2 * 24 * 3600 * 1000


class Counter:
    """Counts records into ``totals`` (row key text -> row value), deduplicated by
    ``seen`` (request id -> position). Remembers which rows changed (``dirty``)
    for the Redis mirror."""

    def __init__(self, seen: MutableMapping[str, Any], totals: MutableMapping[str, Any],
                 clock: Callable[[], int]) -> None:
        self.seen = seen
        self.totals = totals
        self.clock = clock
        self.dirty: set[str] = set()

    def count(self, record: Any, partition: int, offset: int) -> bool:
        """Count ``record``, read at ``offset`` of ``partition``; False when it
        was a repeat of a request counted before."""
        rid = record["request_id"]
        mark = self.seen.get(rid)
        if mark is not None and (mark["p"], mark["o"]) != (partition, offset):
            return False
        now = self.clock()
        if mark is None:
            self.seen[rid] = {"p": partition, "o": offset, "t": now}
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
        """Drop the rows and request ids of ``partition`` past their retention;
        returns how many. Only the partition of the event in hand may be
        swept: a Faust table writes its changelog in that event's partition."""
        now = self.clock()
        dropped = 0
        for rid, mark in list(self.seen.items()):
            if mark["p"] == partition and mark["t"] + SEEN_KEEP_MS <= now:
                del self.seen[rid]
                dropped += 1
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

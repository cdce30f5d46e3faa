"""Counting one UsageRecord into the ledger's tables, exactly once: a record
postprocess wrote twice is dropped when its request id is among the
:data:`SEEN_WINDOW` offsets before it (:class:`SeenWindow`, read back from
the log after a restart or a rebalance: :func:`ids_before`), and a replayed
event leaves alone every row that stores its position or a later one
(docs/decisions/0002-faust-on-the-cold-path-only.md). :class:`Counter` needs
only a mutable mapping."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, MutableMapping
from typing import Any, cast

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from topics.follow import follow
from workers.usage.rows import Counts, RowKey, is_expired, rows_of

__all__ = ["SeenWindow", "SEEN_WINDOW", "ids_before", "request_id_of", "Counter"]


SEEN_WINDOW = 100_000


class SeenWindow:
    """The request ids at the offsets ``[next_offset - size, next_offset)`` of one
    partition (None where the value was not a UsageRecord)."""

    def __init__(self, size: int, next_offset: int) -> None:
        if size < 1:
            raise ValueError(f"a seen window holds at least one offset, not {size}")
        self.size = size
        self.next_offset = next_offset
        self._ids: deque[str | None] = deque()  # one entry per offset, oldest first
        self._copies: dict[str, int] = {}  # id -> how many of its copies are in _ids

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._copies

    def __len__(self) -> int:
        """How many distinct request ids the window holds."""
        return len(self._copies)

    def add(self, offset: int, request_id: str | None) -> None:
        """The id read at ``offset`` (None: no UsageRecord there); offsets only
        grow, and any skipped between hold nothing."""
        if offset < self.next_offset:
            raise ValueError(f"offset {offset} is behind the window's next, {self.next_offset}")
        gap = offset - self.next_offset
        if gap >= self.size:
            self._ids.clear()
            self._copies.clear()
        else:
            for _ in range(gap):
                self._push(None)
        self._push(request_id)
        self.next_offset = offset + 1

    def _push(self, request_id: str | None) -> None:
        self._ids.append(request_id)
        if request_id is not None:
            self._copies[request_id] = self._copies.get(request_id, 0) + 1
        if len(self._ids) > self.size:
            gone = self._ids.popleft()
            if gone is not None:
                left = self._copies[gone] - 1
                if left:
                    self._copies[gone] = left
                else:
                    del self._copies[gone]


# what ids_before reads is bounded by its count: 100,000 records are about 20 MB
_FETCH_BYTES = 8 * 1024 * 1024


def request_id_of(value: bytes | None, codec: Codec) -> str | None:
    """The request id of a usage value; None when it is not a UsageRecord."""
    try:
        return str(codec.decode(value, "UsageRecord")["request_id"])
    except Exception:  # a poison value holds no request id
        return None


async def ids_before(settings: Settings, topic: str, partition: int, offset: int,
                     count: int, codec: Codec | None = None
                     ) -> list[tuple[int, str | None]]:
    """``(offset, request id or None)`` of the records of ``topic[partition]`` in
    ``[offset - count, offset)`` (from the partition's start when that is
    later), in offset order."""
    start = max(0, offset - count)
    if start >= offset:
        return []
    codec = codec or default_codec()
    follower = follow(settings, topic, partition, start,
                      max_partition_fetch_bytes=_FETCH_BYTES)
    found: list[tuple[int, str | None]] = []
    # a generator, closed here so that its consumer stops now, not when collected
    batches = cast(AsyncGenerator[list[Any], None], follower.batches())
    try:
        async for records in batches:
            for record in records:
                if record.offset >= offset:
                    return found
                found.append((record.offset, request_id_of(record.value, codec)))
            if records[-1].offset + 1 >= offset:
                return found
    finally:
        await batches.aclose()
    return found


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
        for key in rows_of(record, partition):
            if is_expired(key.bucket_ms, key.by, now):
                continue  # a late event for a bucket already dropped
            text = key.text()
            row = self.totals.get(text)
            if row is not None and row["p"] == partition and row["o"] >= offset:
                continue  # counted here before a crash; the app replays it
            before = Counts.from_value(row) if row is not None else Counts()
            adds = add.with_ttft_of(record) if key.model_wide else add
            self.totals[text] = before.plus(adds).value(partition, offset)
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

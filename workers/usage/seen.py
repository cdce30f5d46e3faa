"""The request ids of one usage partition's latest events: what a repeat is
checked against.

Postprocess writes a request's UsageRecord again only when it rebuilds the
request from ``conveyor.tokens`` after a crash or a rebalance (see
workers/postprocess/layer.py). Both copies carry the request id and, as the
usage topic is keyed by tenant, land in the same partition, and the second
one lands a bounded number of records after the first:

- postprocess commits a tokens partition every 100 ms, but never past the
  first chunk of a request still open there, and forgets an open request
  ``60 s`` after its deadline. A replay therefore starts no earlier than the
  first chunk of a request that was open at the last commit, and that
  request began at most ``L`` (its time limit plus 60 s) before the crash;
- so everything between the two copies (what postprocess wrote after the
  first copy until the crash, what the replay writes again before it comes
  back to this request, what the other members write meanwhile) is the
  usage traffic of that partition in about ``L`` plus the takeover (the
  session timeout) plus the replay itself. Time during which postprocess
  is down adds nothing: nothing is written then.

A repeat is therefore recognised by its request id among the ids of the
``size`` offsets before it in its partition (:data:`SEEN_WINDOW`, 100,000):
that covers the replays of requests with the default 300 s limit at up to
about 250 usage events a second into one partition (one tenant's whole
traffic), and proportionally longer limits at lower rates. A copy that lands
further back than that (a request held open in postprocess for longer than
the window's traffic: an hour-long ``X-Conveyor-Timeout`` at full rate, or a
batch line whose pool vanished mid-answer) is counted again; the memory is
bounded instead (at most ``size`` ids a partition, about 170 bytes each with
the id itself: 17 MB a partition).

The rule looks only at the log: "the same request id at an offset in
``[offset - size, offset)``" gives the same answer however often the app
restarts, so a window is never stored anywhere. After a restart or a
rebalance it is read back from the usage topic itself (the accounting app
does it when a partition's first event arrives, workers/usage/lookback.py),
and a replay of events after the committed offset is judged exactly as the
first run judged it.
"""

from __future__ import annotations

from collections import deque

__all__ = ["SeenWindow", "SEEN_WINDOW"]

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

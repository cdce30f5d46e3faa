"""The offsets a layer's runtime has taken from one partition, and which of them
are finished (events are handled concurrently, commits stay below the lowest
unfinished one)."""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PartitionBook"]


class PartitionBook:
    """The offsets of one partition a layer took and has not finished yet: what
    may be committed is everything below the lowest unfinished one."""

    def __init__(self) -> None:
        self.open: OrderedDict[int, bool] = OrderedDict()  # offset -> finished
        self.next = 0
        self.pending = 0  # how many of ``open`` are unfinished

    def take(self, offset: int) -> None:
        if offset not in self.open:
            earlier = bool(self.open) and offset < next(reversed(self.open))
            self.open[offset] = False
            self.pending += 1
            if earlier:  # taken again after later ones (a redelivery): keep offset order
                self.open = OrderedDict(sorted(self.open.items()))
        # never back: an offset taken again (a redelivery) reopens only itself
        self.next = max(self.next, offset + 1)

    def finish(self, offset: int) -> None:
        if self.open.get(offset) is False:
            self.open[offset] = True
            self.pending -= 1
        while self.open:
            first = next(iter(self.open))
            if not self.open[first]:
                break
            del self.open[first]

    def low(self) -> int:
        """The lowest unfinished offset (everything below it is done)."""
        return next(iter(self.open)) if self.open else self.next

    def unfinished(self) -> int:
        return self.pending

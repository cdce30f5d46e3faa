"""The offsets taken from each partition and which of them are finished: events
are handled concurrently, and commits stay below the lowest unfinished one
(:class:`PartitionBook` for a layer's runtime; :class:`InFlightOffsets`, the
books of an infer worker's partitions with the epoch of their assignment).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from aiokafka import TopicPartition

__all__ = ["PartitionBook", "InFlightOffsets"]


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


@dataclass
class InFlightOffsets:
    books: dict[TopicPartition, PartitionBook] = field(default_factory=dict)
    # bumped when a partition is forgotten: a generation that outlived its
    # partition must not touch the books of the partition's next assignment
    epochs: dict[TopicPartition, int] = field(default_factory=dict)

    def start(self, tp: TopicPartition, offset: int) -> int:
        """Book a task; returns the epoch to pass to :meth:`finish`."""
        self.books.setdefault(tp, PartitionBook()).take(offset)
        return self.epochs.get(tp, 0)

    def finish(self, tp: TopicPartition, offset: int, epoch: int = 0) -> None:
        book = self.books.get(tp)
        if book is not None and epoch == self.epochs.get(tp, 0):
            book.finish(offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Per partition: below the lowest running task, else after the last taken."""
        return {tp: book.low() for tp, book in self.books.items()}

    def forget(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.books.pop(tp, None)
            self.epochs[tp] = self.epochs.get(tp, 0) + 1

"""Which offsets an infer worker may commit: per partition a
:class:`~workers.inflight.PartitionBook` (below the lowest task still
running), plus the epoch of an assignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka import TopicPartition

from workers.inflight import PartitionBook

__all__ = ["InFlightOffsets"]


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

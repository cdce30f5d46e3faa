"""Which offsets an infer worker may commit.

A task's offset is committed only when its generation has ended, and never
past a task still running, so a worker that dies leaves every unfinished task
to be redelivered to another member of its group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka import TopicPartition

__all__ = ["InFlightOffsets"]


@dataclass
class InFlightOffsets:
    running: dict[TopicPartition, set[int]] = field(default_factory=dict)
    # the offset after the last task taken on each partition
    taken: dict[TopicPartition, int] = field(default_factory=dict)
    # bumped when a partition is forgotten: a generation that outlived its
    # partition must not touch the books of the partition's next assignment
    epochs: dict[TopicPartition, int] = field(default_factory=dict)

    def start(self, tp: TopicPartition, offset: int) -> int:
        """Book a task; returns the epoch to pass to :meth:`finish`."""
        self.running.setdefault(tp, set()).add(offset)
        self.taken[tp] = max(self.taken.get(tp, 0), offset + 1)
        return self.epochs.get(tp, 0)

    def finish(self, tp: TopicPartition, offset: int, epoch: int = 0) -> None:
        if epoch == self.epochs.get(tp, 0):
            self.running.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        out = {}
        for tp, next_offset in self.taken.items():
            running = self.running.get(tp)
            out[tp] = min(running) if running else next_offset
        return out

    def forget(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.running.pop(tp, None)
            self.taken.pop(tp, None)
            self.epochs[tp] = self.epochs.get(tp, 0) + 1

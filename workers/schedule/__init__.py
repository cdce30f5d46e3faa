"""The schedule layer: choose a live worker of the pool and address its partition;
hold background and batch tasks until a worker has room for them."""

from workers.schedule.layer import ScheduleLayer

__all__ = ["ScheduleLayer"]

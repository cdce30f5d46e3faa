"""The schedule layer: choose a live worker of the pool and address its partition."""

from workers.schedule.layer import ScheduleLayer
from workers.schedule.table import WorkerTable

__all__ = ["ScheduleLayer", "WorkerTable"]

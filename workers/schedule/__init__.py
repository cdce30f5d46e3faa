"""The schedule layer: choose a live worker of the pool and address its partition;
hold background and batch tasks until a worker has room for them."""

from workers.schedule.admission import BatchAdmission
from workers.schedule.held import HeldQueue
from workers.schedule.layer import ScheduleLayer
from workers.schedule.table import WorkerTable

__all__ = ["BatchAdmission", "HeldQueue", "ScheduleLayer", "WorkerTable"]

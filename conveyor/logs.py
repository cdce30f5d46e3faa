"""Logging for every Conveyor process: one format, and floods held back.

A broker or Redis outage makes the same line repeat thousands of times a
second (every reconnect attempt of every client). :class:`RepeatFilter`
lets the first of a kind through, then at most one per ``every_s`` seconds
with the count of those held back, so an outage costs a few lines a minute
and the log still says what happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from topics.backoff import Throttle

__all__ = ["RepeatFilter", "setup_logging"]


class RepeatFilter(logging.Filter):
    """Passes a (logger, level, message template) at most once per ``every_s``."""

    def __init__(self, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._throttle = Throttle(every_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        decided = getattr(record, "_conveyor_shown", None)
        if decided is not None:  # another handler asked already: the same answer
            return bool(decided)
        held = self._throttle.admit((record.name, record.levelno, str(record.msg)))
        if held:
            record.msg = f"{record.msg} [{held} more like this in the last {self.every_s:.0f} s]"
        record._conveyor_shown = held is not None  # type: ignore[attr-defined]
        return held is not None


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    repeat = RepeatFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(repeat)
    for noisy in ("aiokafka", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

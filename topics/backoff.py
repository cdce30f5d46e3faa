"""Retrying a failing broker without spinning, and saying so without flooding
the log: :class:`Backoff`, exponential with jitter up to ``max_s`` and reset
by the first success; :class:`RateLimitedLog`, the first line of each kind at
once, then one per ``interval_s`` with the count held back.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from conveyor.logs import Throttle

__all__ = ["Backoff", "RateLimitedLog", "retry_every"]


@dataclass
class Backoff:
    """Exponential backoff with full jitter on the upper half: the n-th wait
    lies in ``[d/2, d]`` where ``d = min(max_s, initial_s * factor**n)``."""

    initial_s: float = 0.1
    max_s: float = 5.0
    factor: float = 2.0
    attempts: int = 0
    rand: Callable[[], float] = field(default=random.random, repr=False)

    def next_delay(self) -> float:
        full = min(self.max_s, self.initial_s * self.factor ** min(self.attempts, 64))
        self.attempts += 1
        return full / 2 + self.rand() * full / 2

    async def wait(self) -> None:
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        self.attempts = 0


class RateLimitedLog:
    """One line per kind of message per ``interval_s``; the rest are counted."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._throttle = Throttle(interval_s, clock)

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` went out less than
        ``interval_s`` ago; returns whether it was written."""
        held = self._throttle.admit(kind)
        if held is None:
            return False
        if held:
            self.logger.log(level, msg + " (%d more like it in the last %.0f s)", *args, held,
                            self.interval_s)
        else:
            self.logger.log(level, msg, *args)
        return True

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)

    def error(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, kind, msg, *args)

    def resolved(self, kind: str, msg: str, *args: object) -> None:
        """The trouble of ``kind`` is over: say so once (if it was ever logged)
        and start counting afresh."""
        if self._throttle.forget(kind):
            self.logger.info(msg, *args)


async def retry_every(name: str, step: Callable[[], Awaitable[None]], every_s: float,
                      max_backoff_s: float, transient: tuple[type[BaseException], ...],
                      logger: logging.Logger) -> None:
    """Run ``step`` every ``every_s`` for ever; a ``transient`` failure (Kafka,
    Redis) is logged and retried after a :class:`Backoff` (from twice
    ``every_s`` up to ``max_backoff_s``); anything else surfaces."""
    backoff = Backoff(initial_s=max(2 * every_s, 0.1), max_s=max_backoff_s)
    while True:
        try:
            await step()
        except transient as exc:
            logger.warning("%s: %r; retrying", name, exc)
            await backoff.wait()
        else:
            backoff.reset()
            await asyncio.sleep(every_s)

"""Waiting at start-up: say what a process waits for, and give up after a bound.

:func:`started` runs one wait (the broker, a consumer group, Redis, an engine
loading), logs ``waiting for X`` after ``note_after_s`` and every
``note_every_s``, retries a refused step (``retry_on``) every ``pause_s``, and
after ``within`` seconds raises :class:`~conveyor.errors.StartupTimeout`
naming what, how long and where (never a password); ``within=None`` never cuts
the wait short. The CLI turns the error into one sentence and exit code 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from conveyor.errors import StartupTimeout

__all__ = ["started", "redis_address", "kafka_address"]

T = TypeVar("T")

_CANCEL_GRACE_S = 5.0  # how long a cancelled step may take to unwind


def redis_address(url: str) -> str:
    """``Redis at host:port/db``, without the user and password of ``url``."""
    return f"Redis at {url.rpartition('@')[2].removeprefix('redis://')}"


def kafka_address(bootstrap: str) -> str:
    return f"Kafka at {bootstrap}"


class _Wait:
    """One narrated wait: what, where, since when, and the last refusal seen."""

    def __init__(self, what: str, where: str, log: logging.Logger) -> None:
        self.what = what
        self.where = where
        self.log = log
        self.t0 = asyncio.get_running_loop().time()
        self.last_error: BaseException | None = None
        self.noted = False

    def elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    def _place(self) -> str:
        return f" ({self.where})" if self.where else ""

    def _last(self) -> str:
        e = self.last_error
        if e is None:
            return ""
        text, kind = str(e), type(e).__name__
        return f"; last error: {text if text.startswith(kind) else f'{kind}: {text}'}"

    def note(self, within: float | None) -> None:
        bound = f", giving up after {within:.0f} s" if within is not None else ""
        self.log.info("waiting for %s%s: %.0f s so far%s%s", self.what, self._place(),
                      self.elapsed(), bound, self._last())
        self.noted = True

    def done(self) -> None:
        if self.noted:
            self.log.info("done waiting for %s%s after %.1f s", self.what, self._place(),
                          self.elapsed())

    def timeout(self) -> StartupTimeout:
        return StartupTimeout(
            f"gave up after {self.elapsed():.0f} s waiting for {self.what}{self._place()}"
            f"{self._last()}", what=self.what, waited_s=self.elapsed(), where=self.where)


async def _attempts(step: Callable[[], Awaitable[T]], wait: _Wait,
                    retry_on: tuple[type[BaseException], ...], pause_s: float) -> T:
    while True:
        try:
            return await step()
        except retry_on as exc:
            wait.last_error = exc
        await asyncio.sleep(pause_s)


async def _cancel(task: asyncio.Task[T]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)


async def started(what: str, step: Callable[[], Awaitable[T]], *, within: float | None,
                  log: logging.Logger, where: str = "",
                  retry_on: tuple[type[BaseException], ...] = (), pause_s: float = 0.5,
                  note_after_s: float = 2.0, note_every_s: float = 5.0) -> T:
    """``await step()``, logging what is awaited while it lasts; past ``within``
    seconds (None: no bound) cancel it and raise :class:`StartupTimeout`.
    ``step`` is tried again after a ``retry_on`` error (a refused connection);
    any other error is raised as it is."""
    wait = _Wait(what, where, log)
    task = asyncio.ensure_future(_attempts(step, wait, retry_on, pause_s))
    loop = asyncio.get_running_loop()
    deadline = None if within is None else wait.t0 + within
    next_note = wait.t0 + note_after_s
    try:
        while True:
            wake = next_note if deadline is None else min(next_note, deadline)
            done, _ = await asyncio.wait({task}, timeout=max(0.0, wake - loop.time()))
            if done:
                result = task.result()
                wait.done()
                return result
            if deadline is not None and loop.time() >= deadline:
                raise wait.timeout()
            wait.note(within)
            next_note += note_every_s
    finally:
        if not task.done():
            await _cancel(task)

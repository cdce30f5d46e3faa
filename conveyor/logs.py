"""Logging for every Conveyor process: one format, and floods held back.
:class:`RepeatFilter` lets one line of a kind through per ``every_s`` with the
count held back; :class:`BatchingHandler` writes per-request loggers' lines
(``conveyor.access``) together, at most ``interval_s`` late, keeping the log's
order. Why: docs/decisions/0015-fewer-writes-at-the-gateway.md.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["BatchingHandler", "RepeatFilter", "Throttle", "setup_logging"]



class Throttle:
    """Lets each key through at most once per ``interval_s`` and counts what it
    held back; the counting core of the log filter every process has
    (:class:`RepeatFilter`) and of :class:`topics.backoff.RateLimitedLog`."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 10_000) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.max_keys = max_keys  # past this many keys all are forgotten: memory is bounded
        self._seen: dict[object, tuple[float, int]] = {}  # key -> (last let through, held)

    def admit(self, key: object) -> int | None:
        """None: held back (counted). Otherwise let through, with how many of
        ``key`` were held back since the last one that was."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            self._seen[key] = (seen[0], seen[1] + 1)
            return None
        if len(self._seen) >= self.max_keys:
            self._seen.clear()
        self._seen[key] = (now, 0)
        return seen[1] if seen is not None else 0

    def forget(self, key: object) -> bool:
        """Start ``key`` afresh; whether it had been seen."""
        return self._seen.pop(key, None) is not None

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


class BatchingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes per-request lines in batches (module docstring)."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 0.1,
                 max_bytes: int = 64 * 1024,
                 batched: frozenset[str] = frozenset({"conveyor.access"})) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.batched = batched  # the loggers whose informational lines wait
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self._lines: list[str] = []
        self._size = 0
        self._pending = threading.Event()
        self._flusher: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:  # called with self.lock held
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._lines.append(line)
        self._size += len(line)
        if (record.levelno >= logging.WARNING or record.name not in self.batched
                or self._size >= self.max_bytes):
            self._write()
        elif not self._pending.is_set():
            self._pending.set()
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_later, daemon=True,
                                                 name="log-flusher")
                self._flusher.start()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write()

    def _write(self) -> None:
        if self._lines:
            text = "".join(self._lines)
            self._lines.clear()
            self._size = 0
            try:
                self.stream.write(text)
            except Exception:  # a closed or broken stream: as StreamHandler, never raise
                pass
        super().flush()

    def _flush_later(self) -> None:
        while True:
            self._pending.wait()
            time.sleep(self.interval_s)
            with self.lock:  # type: ignore[union-attr]
                self._pending.clear()
                self._write()


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), handlers=[BatchingHandler()],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    repeat = RepeatFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(repeat)
    for noisy in ("aiokafka", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

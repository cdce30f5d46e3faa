"""RepeatFilter: an outage's repeated lines are held back, and counted. BatchingHandler:
informational lines written together, warnings at once, nothing held past a flush."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

from conveyor.logs import BatchingHandler, RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("aiokafka", level, __file__, 1, msg, None, None)


def test_a_repeated_line_passes_once_per_period_with_the_count_held_back() -> None:
    clock = Clock()
    f = RepeatFilter(every_s=10, clock=clock)
    assert f.filter(record("Unable connect to node %s"))
    shown = [f.filter(record("Unable connect to node %s")) for _ in range(700)]
    assert not any(shown)
    clock.now = 10.5
    later = record("Unable connect to node %s")
    assert f.filter(later)
    assert "700 more like this" in str(later.msg)


def test_other_lines_and_info_lines_are_not_held_back() -> None:
    f = RepeatFilter(every_s=10, clock=Clock())
    assert f.filter(record("a")) and f.filter(record("b"))
    assert all(f.filter(record("request done", logging.INFO)) for _ in range(5))


def test_two_handlers_with_one_filter_show_the_same_lines() -> None:
    f = RepeatFilter(every_s=10, clock=Clock())
    r = record("Heartbeat failed")
    assert f.filter(r) and f.filter(r)  # the second handler must not see a repeat


# --- BatchingHandler -----------------------------------------------------------------------


def _name(name: str) -> str:
    return f"conveyor.test.batching.{name}"


def _handler(stream: io.StringIO, *names: str, **kwargs: Any) -> BatchingHandler:
    return BatchingHandler(stream, batched=frozenset(map(_name, names)), **kwargs)


def _logger(handler: logging.Handler, name: str) -> logging.Logger:
    logger = logging.getLogger(_name(name))
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    return logger


def test_informational_lines_are_written_together_after_the_interval() -> None:
    stream = io.StringIO()
    handler = _handler(stream, "interval", interval_s=0.05)
    logger = _logger(handler, "interval")
    for i in range(3):
        logger.info("request %d", i)
    assert stream.getvalue() == ""
    deadline = time.monotonic() + 5
    while not stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.getvalue() == "INFO request 0\nINFO request 1\nINFO request 2\n"
    logger.info("later")
    while "later" not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.getvalue().endswith("INFO later\n")


def test_a_warning_is_written_at_once_after_the_lines_before_it() -> None:
    stream = io.StringIO()
    logger = _logger(_handler(stream, "warning", interval_s=60), "warning")
    logger.info("first")
    logger.warning("broker gone")
    assert stream.getvalue() == "INFO first\nWARNING broker gone\n"


def test_a_full_batch_and_a_flush_write_what_is_held() -> None:
    stream = io.StringIO()
    handler = _handler(stream, "full", interval_s=60, max_bytes=40)
    logger = _logger(handler, "full")
    logger.info("%s", "x" * 10)
    assert stream.getvalue() == ""
    logger.info("%s", "y" * 30)  # past 40 bytes held
    assert stream.getvalue() == f"INFO {'x' * 10}\nINFO {'y' * 30}\n"
    logger.info("tail")
    handler.flush()  # what logging.shutdown does as the process exits
    assert stream.getvalue().endswith("INFO tail\n")


def test_a_line_of_any_other_logger_is_written_at_once_after_the_held_ones() -> None:
    """What a process says of itself (a model evicted, a broker lost) is in its log as it
    happens: a pipeline test read a worker's log right after an answer and found its
    eviction line still held."""
    stream = io.StringIO()
    handler = _handler(stream, "access", interval_s=60)
    access, other = _logger(handler, "access"), _logger(handler, "model_set")
    access.info("GET /v1/models 200")
    assert stream.getvalue() == ""
    other.info("model evicted")
    assert stream.getvalue() == "INFO GET /v1/models 200\nINFO model evicted\n"


def test_the_access_log_is_what_is_batched_by_default() -> None:
    assert BatchingHandler(io.StringIO()).batched == frozenset({"conveyor.access"})

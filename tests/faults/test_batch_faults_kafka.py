"""An OpenAI Batch across a Kafka outage: the broker (one of the test's own)
stops while a 10-line batch runs (two lines answered, the others queued or
being generated) and comes back a few seconds later. The
batch still completes and every custom_id is in its output or error file
exactly once: no line lost in the outage, none written twice by the
redeliveries that follow it. Driven by the official ``openai`` client against
real processes.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from tests.pipeline.test_batches import client, line, lines_of, upload
from tests.support.pipeline import Pipeline
from tests.support.services import OwnKafka

LINES = 10
OUTAGE_S = 4.0
# the broker stops once this many lines are answered: mid-batch, lines in flight
STOP_AFTER = 2
FINAL_WITHIN_S = 180.0


def _retrieve(c: openai.OpenAI, batch_id: str, within: float) -> Any:
    """The batch as the gateway shows it, asking again while the gateway
    answers 503 (it cannot see Kafka yet) or is slow to answer."""
    deadline = time.monotonic() + within
    while True:
        try:
            return c.batches.retrieve(batch_id)
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _until(c: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], within: float) -> Any:
    deadline = time.monotonic() + within
    while True:
        batch = _retrieve(c, batch_id, within)
        if done(batch) or time.monotonic() > deadline:
            return batch
        time.sleep(0.2)


def _jobs_lines(p: Pipeline, lines: int = 120) -> str:
    """The layers' log lines about jobs and the dead-letter topic (what a
    failure of the dead-command test needs to be read)."""
    text = p.tail("layers", 5000)
    return "\n".join([x for x in text.splitlines()
                      if "dead" in x or "jobs" in x or "dlq" in x][-lines:])


def test_a_batch_completes_across_a_kafka_stop_and_restart(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka,
        tmp_path: Path) -> None:
    p = pipeline_factory(workers=1, contexts=2, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                         CONVEYOR_FILES_DIR=str(tmp_path / "files"))
    c = client(p)
    ids = [f"k-{i}" for i in range(LINES)]
    batch = c.batches.create(
        input_file_id=upload(c, [line(i, f"Count from 1 to {n % 5 + 6}.", max_tokens=24)
                                 for n, i in enumerate(ids)]),
        endpoint="/v1/chat/completions", completion_window="24h")
    running = _until(c, batch.id, lambda b: b.status != "validating" and (
        b.request_counts is None or b.request_counts.completed >= STOP_AFTER), 120)
    assert running.status == "in_progress", running
    assert running.request_counts.completed < LINES, f"it ended before the outage: {running}"
    own_kafka.stop()
    time.sleep(OUTAGE_S)
    own_kafka.start()
    started = time.monotonic()
    done = _until(c, batch.id, lambda b: b.status in ("completed", "failed", "cancelled",
                                                        "expired"), FINAL_WITHIN_S)
    print(f"\nKafka stopped at {running.request_counts.completed} of {LINES} lines for "
          f"{OUTAGE_S:.0f} s; the batch ended {time.monotonic() - started:.1f} s after the "
          f"restart: {done.request_counts}")
    assert done.status == "completed", done
    out = lines_of(c, done.output_file_id)
    errors = lines_of(c, done.error_file_id)
    seen = Counter(x["custom_id"] for x in out + errors)
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}, seen
    counts = done.request_counts
    assert counts is not None and counts.total == LINES, done
    assert counts.completed + counts.failed == LINES, done
    assert counts.completed == len(out) and counts.failed == len(errors), done
    assert not errors, errors[:3]
    # a passing outage is retried, never dead-lettered
    assert json.loads(p.cli("dlq", "list", "--json")) == []


def test_a_dead_command_after_a_kafka_restart_still_fails_its_batch(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka,
        tmp_path: Path) -> None:
    """The jobs layer's follower of the dead-letter topic lives through the
    broker's outage: a create command it cannot read, written after the restart,
    still ends its batch ``failed`` instead of leaving it ``validating``."""
    from tests.pipeline.workers.jobs.test_undecodable_commands import (
        _batch_object,
        _upload,
        _write_status_and_command,
    )

    p = pipeline_factory(workers=1, contexts=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                         CONVEYOR_FILES_DIR=str(tmp_path / "files"))
    c = client(p)
    file_id = _upload(c, 2)
    own_kafka.stop()
    time.sleep(OUTAGE_S)
    own_kafka.start()
    batch_id = f"batch_{time.time_ns()}"
    deadline = time.monotonic() + 120
    while True:  # the broker takes a while to serve again after its start
        try:
            _write_status_and_command(p, _batch_object(batch_id, file_id), b"\x00after")
            break
        except Exception:
            assert time.monotonic() < deadline, "the broker did not come back"
            time.sleep(1)
    done = _until(c, batch_id, lambda b: b.status not in ("validating", "in_progress"), 120)
    assert done.status == "failed", f"{done}\n{_jobs_lines(p)}"
    assert done.errors is not None and done.errors.data[0].code == "invalid_command"

"""An OpenAI Batch through SIGKILL of each Conveyor process: an infer worker,
the layers process (jobs, results and every pipeline layer), the gateway, and
the layers process again while the batch is being expanded. Driven by the
official ``openai`` client against real processes on the real broker.

Each test runs a batch of short lines, kills one process while the batch is
under way and checks the finished batch: ``completed``, request counts that
add up (completed + failed == total, none failed), every custom_id exactly
once across the output and error files, no empty answer, and from
``conveyor.tokens`` that no line was generated from its start twice (a retry
continues a line or skips it; it never runs it again). What a test killed is
started again before the next test (even when the test failed half way), so
the module shares one pipeline: two infer workers of one context each, and a
file store of its own.

The time to the final state is printed beside a fault-free batch's (run with
``-s`` to see it): a worker's death costs the infer group's session timeout
(1.5 s) and a continued line; the layers' death costs a process start, their
consumer groups' session timeout (6 s) and a refold of the batch from
``conveyor.results``; the gateway's, only the client's wait for a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.codec import default_codec
from tests.pipeline.test_batches import client, line, lines_of, upload, wait
from tests.support.pipeline import Pipeline
from topics.catalog import TOKENS
from topics.reader import REQUEST_IDS

LINES = 36
MAX_TOKENS = 8
EXPANDED_LINES = 300
# the expanded batch is about its expansion, not its answers: two tokens a line
# (eight would cost its 300 lines about 25 s on the module's two workers)
EXPANDED_MAX_TOKENS = 2
# the kills strike once this many lines completed: the batch is well under way
COMPLETED_BEFORE_KILL = 6
FINAL_WITHIN_S = 300.0


def batch_lines(tag: str, n: int, max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    return [line(f"{tag}-{i}", f"Count from 1 to {i % 5 + 3}.", max_tokens=max_tokens)
            for i in range(n)]


def create(c: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    return c.batches.create(input_file_id=upload(c, lines), endpoint="/v1/chat/completions",
                            completion_window="24h")


# -- what the pipeline's topics and Redis show of a batch -------------------------

async def _consumer(p: Pipeline, name: str) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
    """A consumer of every partition of a pipeline topic (requests, tokens)."""
    topic = p.settings.kafka.topic(name)
    consumer = AIOKafkaConsumer(bootstrap_servers=p.settings.kafka.bootstrap,
                                enable_auto_commit=False, fetch_max_wait_ms=10)
    await consumer.start()
    tps = [TopicPartition(topic, n) for n in range(p.settings.kafka.pipeline_partitions)]
    consumer.assign(tps)
    return consumer, tps


def _is_of(batch_id: str, record: Any) -> bool:
    """A record of the batch's requests: by its key, or (conveyor.tokens, whose
    records hold many requests' chunks) by the request ids it names."""
    ids = dict(record.headers or ()).get(REQUEST_IDS, record.key or b"").split(b",")
    return any(i.startswith(f"{batch_id}-".encode()) for i in ids)


async def _read_all(p: Pipeline, name: str, batch_id: str) -> list[Any]:
    """Every record of the batch's requests on a pipeline topic, as it is now."""
    consumer, tps = await _consumer(p, name)
    records: list[Any] = []
    try:
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                [await consumer.position(tp) < ends[tp] for tp in tps]):
            for got in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(r for r in got if _is_of(batch_id, r))
    finally:
        await consumer.stop()
    return records


@dataclass
class Runs:
    """The generation runs of each line of a batch, from ``conveyor.tokens``:
    request id -> run id -> (worker, the seq the run began at)."""

    lines: dict[str, dict[str, tuple[str, int]]]

    def workers(self, request_id: str) -> set[str]:
        return {w for w, _ in self.lines.get(request_id, {}).values()}

    def by(self, worker: str) -> int:
        return sum(1 for rid in self.lines if worker in self.workers(rid))

    def started_twice(self) -> list[str]:
        return sorted(rid for rid, runs in self.lines.items()
                      if sum(1 for _, start in runs.values() if start == 0) > 1)

    def continued(self) -> list[str]:
        return sorted(rid for rid, runs in self.lines.items()
                      if any(start > 0 for _, start in runs.values()))


def runs_of(p: Pipeline, batch_id: str) -> Runs:
    codec = default_codec()
    lines: dict[str, dict[str, tuple[str, int]]] = {}
    for record in asyncio.run(_read_all(p, "tokens", batch_id)):
        for chunk in TOKENS.unpack(codec, record.value):
            if not chunk["envelope"]["request_id"].startswith(f"{batch_id}-"):
                continue
            lines.setdefault(chunk["envelope"]["request_id"], {})[chunk["run_id"]] = (
                chunk["worker_id"], chunk["run_start"])
    return Runs(lines)


def in_flight(p: Pipeline, batch_id: str, lines: int) -> dict[str, str]:
    """The batch's lines being generated now (request id -> worker id): leased
    to a worker (``{prefix}:lease:<id>``) and not done (``{prefix}:claim:<id>``)."""
    ids = [f"{batch_id}-{i}" for i in range(lines)]
    r = redis.Redis.from_url(p.settings.redis.url, decode_responses=True)
    try:
        leases = r.mget([f"{p.prefix}:lease:{i}" for i in ids])
        claims = r.mget([f"{p.prefix}:claim:{i}" for i in ids])
    finally:
        r.close()
    return {rid: str(lease) for rid, lease, claim in zip(ids, leases, claims, strict=True)
            if lease and not str(claim or "").startswith("done:")}


# -- the checks ------------------------------------------------------------------------

def check(c: openai.OpenAI, p: Pipeline, done: Any, ids: list[str]) -> Runs:
    """Completed, each custom_id once across both files, counts that add up, no
    failed line, no empty answer, and no line generated from its start twice."""
    assert done.status == "completed", done
    out = lines_of(c, done.output_file_id)
    errors = lines_of(c, done.error_file_id)
    seen = Counter(x["custom_id"] for x in out + errors)
    missing = [i for i in ids if i not in seen]
    doubled = sorted(i for i, n in seen.items() if n > 1)
    unknown = sorted(set(seen) - set(ids))
    assert (missing, doubled, unknown) == ([], [], []), \
        f"missing {missing}, doubled {doubled}, unknown {unknown}; batch {done}"
    counts = done.request_counts
    assert counts is not None, done
    assert counts.total == len(ids), done
    assert counts.completed + counts.failed == counts.total, done
    assert counts.failed == 0 and not errors, errors[:3]
    bad = [o["custom_id"] for o in out
           if o["error"] is not None or o["response"]["status_code"] != 200
           or not o["response"]["body"]["choices"][0]["message"]["content"]]
    assert not bad, f"empty or failed answers: {bad}"
    runs = runs_of(p, done.id)
    assert len(runs.lines) == len(ids), f"lines without tokens: {len(ids) - len(runs.lines)}"
    assert not runs.started_twice(), f"generated twice from the start: {runs.started_twice()}"
    return runs


def until_completed(c: openai.OpenAI, batch_id: str, n: int, within: float = 120.0) -> Any:
    """The batch once at least ``n`` of its lines completed (and before it ends)."""
    deadline = time.monotonic() + within
    while True:
        now = c.batches.retrieve(batch_id)
        if now.request_counts is not None and now.request_counts.completed >= n:
            assert now.status == "in_progress", f"it ended before the fault: {now}"
            return now
        assert time.monotonic() < deadline, f"{n} lines did not complete: {now}"
        time.sleep(0.1)


def report(what: str, took: float, lines: int, baseline: float) -> None:
    print(f"\n{what}: {lines} lines in {took:.1f} s "
          f"({took / lines:.2f} s a line; without faults {baseline / LINES:.2f} s a line)")


# -- the pipeline, and undoing the faults ------------------------------------------

def wait_healthy(p: Pipeline, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert p.procs["gateway"].poll() is None, p.tail("gateway")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{p.base_url}/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"the restarted gateway did not become healthy:\n{p.tail('gateway')}")


@pytest.fixture(scope="module")
def conveyor(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    files = tmp_path_factory.mktemp("files")
    p = Pipeline(tmp_path_factory.mktemp("logs"), CONVEYOR_FILES_DIR=str(files))
    try:
        p.start(workers=2, contexts=1)
        yield p
    finally:
        p.close()


@pytest.fixture
def p(conveyor: Pipeline) -> Iterator[Pipeline]:
    """The module's pipeline, made whole again after the test."""
    try:
        yield conveyor
    finally:
        conveyor.heal()


@pytest.fixture(scope="module")
def baseline_s(conveyor: Pipeline) -> float:
    """Seconds a fault-free batch of :data:`LINES` lines takes to complete."""
    c = client(conveyor)
    started = time.monotonic()
    batch = create(c, batch_lines("base", LINES))
    done = wait(c, batch.id, timeout=FINAL_WITHIN_S)
    took = time.monotonic() - started
    check(c, conveyor, done, [f"base-{i}" for i in range(LINES)])
    print(f"\nwithout faults: {LINES} lines in {took:.1f} s")
    return took


# -- the tests -----------------------------------------------------------------------

def test_a_batch_completes_when_an_infer_worker_is_killed(p: Pipeline,
                                                          baseline_s: float) -> None:
    """The killed worker is one generating a line of the batch at that moment;
    the survivor continues that line and runs the rest."""
    c = client(p)
    started = time.monotonic()
    batch = create(c, batch_lines("w", LINES))
    until_completed(c, batch.id, COMPLETED_BEFORE_KILL)
    deadline = time.monotonic() + 10
    while not (running := in_flight(p, batch.id, LINES)):
        assert time.monotonic() < deadline, "no line of the batch was being generated"
        time.sleep(0.05)
    line_id, victim = next(iter(running.items()))
    p.kill(victim)
    done = wait(c, batch.id, timeout=FINAL_WITHIN_S)
    report(f"infer worker {victim} killed generating {line_id}", time.monotonic() - started,
           LINES, baseline_s)
    runs = check(c, p, done, [f"w-{i}" for i in range(LINES)])
    print(f"{line_id} was generated by {sorted(runs.workers(line_id))}; {victim} generated "
          f"{runs.by(victim)} of {LINES} lines; continued: {runs.continued()}")
    assert runs.by(victim) >= 1, "the killed worker generated no line of the batch"


def test_a_batch_completes_when_the_layers_process_is_killed_and_restarted(
        p: Pipeline, baseline_s: float) -> None:
    c = client(p)
    started = time.monotonic()
    batch = create(c, batch_lines("l", LINES))
    at_kill = until_completed(c, batch.id, COMPLETED_BEFORE_KILL)
    p.kill("layers")
    p.respawn("layers")
    done = wait(c, batch.id, timeout=FINAL_WITHIN_S)
    report(f"layers killed at {at_kill.request_counts.completed} completed, restarted",
           time.monotonic() - started, LINES, baseline_s)
    runs = check(c, p, done, [f"l-{i}" for i in range(LINES)])
    print(f"continued lines: {runs.continued()}")


def test_a_batch_completes_and_is_served_by_a_restarted_gateway(
        p: Pipeline, baseline_s: float) -> None:
    """The new gateway knows the batch from ``conveyor.job-status`` alone."""
    c = client(p)
    started = time.monotonic()
    batch = create(c, batch_lines("g", LINES))
    until_completed(c, batch.id, COMPLETED_BEFORE_KILL)
    p.kill("gateway")
    p.respawn("gateway")
    wait_healthy(p)
    again = client(p)
    seen = again.batches.retrieve(batch.id)
    assert seen.id == batch.id and seen.status in ("in_progress", "finalizing", "completed")
    assert seen.request_counts is not None
    assert seen.request_counts.completed >= COMPLETED_BEFORE_KILL, seen
    assert any(b.id == batch.id for b in again.batches.list())
    done = wait(again, batch.id, timeout=FINAL_WITHIN_S)
    report(f"gateway killed, restarted (it first saw the batch {seen.status}, "
           f"{seen.request_counts.completed} completed)", time.monotonic() - started, LINES,
           baseline_s)
    check(again, p, done, [f"g-{i}" for i in range(LINES)])


@dataclass
class Expansion:
    """What the requests topic showed of a batch's expansion around the kill."""

    batch_id: str = ""
    at_kill: int = 0  # the batch's request events seen when the kill struck
    by_the_dead: int = 0  # those the killed process had produced in all


async def _kill_mid_expansion(p: Pipeline, c: openai.OpenAI) -> Expansion:
    """Create the batch and SIGKILL the layers process at the first request of
    the batch that reaches ``conveyor.requests``. The jobs layer sends a
    batch's requests in one go, so the kill lands once they are all out but
    (as a rule: the runtime commits within 0.2 s) before the command's offset
    is committed, and the restarted layer expands the batch again."""
    consumer, tps = await _consumer(p, "requests")
    seen = Expansion()
    try:
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        lines = batch_lines("x", EXPANDED_LINES, EXPANDED_MAX_TOKENS)
        file_id = await asyncio.to_thread(upload, c, lines)
        batch = await asyncio.to_thread(c.batches.create, input_file_id=file_id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
        seen.batch_id = batch.id
        deadline = time.monotonic() + 60
        while seen.at_kill == 0:
            assert time.monotonic() < deadline, "the batch was never expanded"
            got = await consumer.getmany(timeout_ms=10)
            seen.at_kill += sum(_is_of(batch.id, r) for rs in got.values() for r in rs)
        p.kill("layers")
        seen.by_the_dead = seen.at_kill
        for _ in range(5):  # what the dead process had sent is on the topic by now
            got = await consumer.getmany(timeout_ms=200)
            seen.by_the_dead += sum(_is_of(batch.id, r) for rs in got.values() for r in rs)
    finally:
        await consumer.stop()
    return seen


def test_a_batch_killed_while_being_expanded_runs_each_line_once(
        p: Pipeline, baseline_s: float) -> None:
    """A command handled again after the kill sends the same request ids
    again: the pipeline treats them as retries, nothing runs twice."""
    c = client(p)
    started = time.monotonic()
    seen = asyncio.run(_kill_mid_expansion(p, c))
    status_at_kill = c.batches.retrieve(seen.batch_id).status
    p.respawn("layers")
    done = wait(c, seen.batch_id, timeout=FINAL_WITHIN_S)
    took = time.monotonic() - started
    events = Counter(r.key for r in asyncio.run(_read_all(p, "requests", seen.batch_id)))
    print(f"\nlayers killed mid-expansion (batch {status_at_kill}): {seen.at_kill} of "
          f"{EXPANDED_LINES} requests on the topic at the kill, {seen.by_the_dead} sent by "
          f"the killed process; {sum(events.values())} request events in all for "
          f"{len(events)} request ids")
    report("layers killed mid-expansion, restarted", took, EXPANDED_LINES, baseline_s)
    check(c, p, done, [f"x-{i}" for i in range(EXPANDED_LINES)])
    assert len(events) == EXPANDED_LINES

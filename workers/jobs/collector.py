"""The results layer: folds each job's events (``conveyor.results``) into its
state, publishes it on ``conveyor.job-status`` (a status change at once,
counts at most every :data:`PUBLISH_EVERY_S`) and finishes batches by
writing their output and error files under ids derived from the batch id;
a partition's commit never passes the first event of a job not final there."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from aiokafka import TopicPartition

from conveyor.files.local import LocalFileStore
from conveyor.settings import Settings
from schemas.records import JobResult, JobStatus
from topics.backoff import RateLimitedLog
from topics.catalog import JOB_STATUS, RESULTS
from topics.envelope import now_ms
from workers.jobs.folds import BatchFold, ResponseFold
from workers.layer import Layer
from workers.outputs import Output, Sender

__all__ = ["ResultsLayer", "output_file_id", "PUBLISH_EVERY_S", "CANCEL_GRACE_MS"]

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 0.5
CANCEL_GRACE_MS = 5_000
_TICK_S = 0.5
_FINISHED_MEMORY = 10_000

Fold = BatchFold | ResponseFold


def output_file_id(job_id: str, which: str, created_s: int) -> str:
    """The id of a batch's output (or error) file: the same on every attempt.
    Like every file id it starts with a time in milliseconds (the batch's
    creation), so files still list in about the order they were made."""
    digest = hashlib.sha256(f"{job_id}/{which}".encode()).hexdigest()[:12]
    return f"file-{(created_s * 1000) & 0xFFFF_FFFF_FFFF:012x}{digest}"


class ResultsLayer(Layer):
    name = "results"
    source = RESULTS

    def __init__(self, settings: Settings, files: LocalFileStore) -> None:
        self.settings = settings
        self.files = files
        self._status_topic = JOB_STATUS.at(settings.kafka)
        self.folds: dict[str, Fold] = {}
        self._first: dict[str, tuple[TopicPartition, int]] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._published: dict[str, tuple[float, str]] = {}  # job -> (when, status)
        self._dirty: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._sender: Sender | None = None
        self._tick: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # a job became final: publish it now
        self._problems = RateLimitedLog(log)

    async def start(self, sender: Sender) -> None:
        self._sender = sender
        self._tick = asyncio.create_task(self._tick_loop(), name="results-tick")

    async def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick

    async def handle(self, event: JobResult, record: Any) -> list[Output]:
        if self._tick is not None and self._tick.done():
            self._tick.result()  # a failed tick surfaces here, never lost
        job_id = event["job_id"]
        if job_id in self._finished:
            return []
        fold = self.folds.get(job_id)
        if fold is None:
            fold = BatchFold(job_id) if job_id.startswith("batch_") else ResponseFold(job_id)
            self.folds[job_id] = fold
            if record is not None:
                self._first[job_id] = (TopicPartition(record.topic, record.partition),
                                       record.offset)
        async with self._lock(job_id):
            if not fold.apply(event):
                return []
            return await self._after_change(fold)

    def _lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    async def _after_change(self, fold: Fold) -> list[Output]:
        if isinstance(fold, BatchFold) and fold.all_ended():
            await self._finish_batch(fold, "cancelled" if fold.status == "cancelling"
                                     else "completed")
        last = self._published.get(fold.job_id)
        due = last is None or last[1] != fold.status or \
            time.monotonic() - last[0] >= PUBLISH_EVERY_S
        if fold.final or not due:
            # a final state is published by the tick (woken at once), which forgets
            # the job only once the broker has it: until then its first offset
            # holds the commit
            self._dirty.add(fold.job_id)
            if fold.final:
                self._wake.set()
            return []
        return [self._status(fold)]

    async def _finish_batch(self, fold: BatchFold, status: str) -> None:
        """Write the output and error files (ids fixed by the batch id), then the
        final status. A file that cannot be written (a full disk) leaves the batch
        open: the tick tries again."""
        ok, failed = fold.output_lines()
        try:
            out_id = await self._write(fold, "output", ok) if ok else None
            err_id = await self._write(fold, "error", failed) if failed else None
        except OSError as exc:
            self._problems.error("write", "batch %s: its files cannot be written (%s); "
                                 "trying again", fold.job_id, exc)
            return
        fold.finish(status, now_ms(), out_id, err_id)
        log.info("batch %s: %s (%d answered, %d failed)", fold.job_id, status, len(ok),
                 len(failed))

    async def _write(self, fold: BatchFold, which: str, lines: list[str]) -> str:
        file_id = output_file_id(fold.job_id, which, int(fold.base.get("created_at") or 0))
        data = ("\n".join(lines) + "\n").encode()
        await self.files.create(fold.tenant, "batch_output", f"{fold.job_id}_{which}.jsonl",
                                data, file_id=file_id)
        return file_id

    def _status(self, fold: Fold) -> Output:
        self._published[fold.job_id] = (time.monotonic(), fold.status)
        self._dirty.discard(fold.job_id)
        status = JobStatus(job_id=fold.job_id,
                           kind="batch" if isinstance(fold, BatchFold) else "response",
                           tenant=fold.tenant, version=time.time_ns() // 1000, ts_ms=now_ms(),
                           object=json.dumps(fold.object(), ensure_ascii=False))
        return Output(self._status_topic, "JobStatus", status, key=fold.job_id)

    def _forget(self, job_id: str, ended: bool = True) -> None:
        """Drop a job's state: it ended (remembered, so that a late event of it
        is passed over), or its partition went to another member."""
        self.folds.pop(job_id, None)
        self._first.pop(job_id, None)
        self._published.pop(job_id, None)
        self._dirty.discard(job_id)
        if ended:
            self._locks.pop(job_id, None)
            self._finished[job_id] = None
            while len(self._finished) > _FINISHED_MEMORY:
                self._finished.popitem(last=False)

    async def _tick_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _TICK_S)
            self._wake.clear()
            outputs, finished = await self.tick(now_ms())
            if outputs and self._sender is not None:
                await self._sender.produce(outputs)
            for job_id in finished:
                self._forget(job_id)

    async def tick(self, now: int) -> tuple[list[Output], list[str]]:
        """Held-back states to publish (finishing quiet cancelled batches and
        expired ones), and the jobs to forget once they are published."""
        outputs: list[Output] = []
        finished: list[str] = []
        for job_id, fold in list(self.folds.items()):
            async with self._lock(job_id):
                if self.folds.get(job_id) is not fold:
                    continue
                if isinstance(fold, BatchFold) and not fold.final:
                    expires = int(fold.base.get("expires_at") or 0) * 1000
                    if fold.all_ended():  # its files could not be written before
                        await self._finish_batch(fold, "cancelled" if fold.status ==
                                                 "cancelling" else "completed")
                    elif fold.status == "cancelling" and \
                            now - fold.last_event_ms >= CANCEL_GRACE_MS:
                        await self._finish_batch(fold, "cancelled")
                    elif expires and now >= expires and fold.status in ("validating",
                                                                        "in_progress"):
                        await self._finish_batch(fold, "expired")
                if fold.final or job_id in self._dirty:
                    outputs.append(self._status(fold))
                    if fold.final:
                        finished.append(job_id)
        return outputs, finished

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """Never commit past the first event of a job still open on ``tp``."""
        firsts = [off for (p, off) in self._first.values() if p == tp]
        return min([next_offset, *firsts])

    def revoked(self, partitions: list[TopicPartition]) -> None:
        gone = set(partitions)
        for job_id in [j for j, (tp, _) in self._first.items() if tp in gone]:
            self._forget(job_id, ended=False)

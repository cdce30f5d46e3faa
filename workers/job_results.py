"""A job's own events in its results stream: a request that belongs to a
job, and the job-level events (expanded, invalid, cancel) written to
``conveyor.results`` (key = job id) beside its requests' results
(:func:`workers.outputs.result_output`), so the job's collector
(:mod:`workers.jobs.collector`) reads them in order.
"""

from __future__ import annotations

from conveyor.settings import Settings
from schemas.records import Envelope, JobResult
from topics.catalog import RESULTS
from topics.envelope import now_ms
from workers.outputs import Output

__all__ = ["is_job", "job_event"]


def is_job(envelope: Envelope) -> bool:
    """The request belongs to a job (a batch line, a background response): it
    has no client connection waiting, and it ends in a result, not a reply."""
    return bool(envelope.get("job_id"))


def job_event(settings: Settings, job_id: str, event: str, detail: str = "") -> Output:
    """A job-level event (expanded, invalid, cancel) in the job's results stream."""
    record = JobResult(job_id=job_id, event=event, request_id="", job_item="",  # type: ignore[typeddict-item]
                       status_code=0, body="", error=None, text="", finish_reason=None,
                       usage=None, detail=detail, ts_ms=now_ms())
    return Output(RESULTS.at(settings.kafka), "JobResult", record, key=job_id)

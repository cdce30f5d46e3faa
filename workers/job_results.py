"""How a job's request ends: a :class:`~schemas.records.JobResult` on
``conveyor.results`` (key = job id), instead of a reply to a gateway.

A request whose envelope names a job (``job_id``: a batch line, a background
response) has no client connection waiting for it. Every way it can end (an
answer assembled by postprocess, an error from any layer) becomes one result
event, so the job's collector (:mod:`workers.jobs.collector`) sees every
request of the job end exactly where it reads, in order with the job's own
events.
"""

from __future__ import annotations

from conveyor.settings import Settings
from schemas.records import Envelope, ErrorInfo, JobResult, Usage
from topics.catalog import RESULTS
from topics.envelope import now_ms
from workers.outputs import Output

__all__ = ["is_job", "result_output", "job_event"]


def is_job(envelope: Envelope) -> bool:
    return bool(envelope.get("job_id"))


def result_output(settings: Settings, envelope: Envelope, *, status_code: int,
                  body: str = "", error: ErrorInfo | None = None, text: str = "",
                  finish_reason: str | None = None, usage: Usage | None = None) -> Output:
    """The result of one request of a job."""
    result = JobResult(job_id=envelope["job_id"], event="result",
                       request_id=envelope["request_id"], job_item=envelope["job_item"],
                       status_code=status_code, body=body, error=error, text=text,
                       finish_reason=finish_reason, usage=usage, detail="", ts_ms=now_ms())
    return Output(RESULTS.at(settings), "JobResult", result, key=envelope["job_id"])


def job_event(settings: Settings, job_id: str, event: str, detail: str = "") -> Output:
    """A job-level event (expanded, invalid, cancel) in the job's results stream."""
    record = JobResult(job_id=job_id, event=event, request_id="", job_item="",  # type: ignore[typeddict-item]
                       status_code=0, body="", error=None, text="", finish_reason=None,
                       usage=None, detail=detail, ts_ms=now_ms())
    return Output(RESULTS.at(settings), "JobResult", record, key=job_id)

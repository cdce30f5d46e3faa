"""A job's state, folded from its events: batches and background responses."""

from __future__ import annotations

import json
from typing import Any

from schemas.records import JobResult
from workers.jobs.folds import BatchFold, ResponseFold


def event(kind: str, request_id: str = "", status: int = 0, detail: Any = None,
          text: str = "", finish: str | None = None, item: str = "",
          job: str = "batch_1") -> JobResult:
    body = json.dumps({"id": request_id}) if status == 200 else ""
    error = {"status": status, "type": "invalid_request_error", "code": None, "param": None,
             "message": "bad"} if status not in (0, 200) else None
    usage = {"prompt_tokens": 3, "completion_tokens": 2} if status == 200 else None
    return JobResult(job_id=job, event=kind, request_id=request_id, job_item=item,  # type: ignore[typeddict-item]
                     status_code=status, body=body, error=error, text=text,  # type: ignore[typeddict-item]
                     finish_reason=finish, usage=usage,  # type: ignore[typeddict-item]
                     detail=json.dumps(detail) if detail is not None else "", ts_ms=1_000_000)


def expanded(total: int) -> JobResult:
    return event("expanded", detail={"object": {"id": "batch_1", "object": "batch",
                                                "expires_at": 10**10}, "total": total,
                                     "tenant": "acme"})


def test_a_batch_runs_to_its_end_counting_each_request_once() -> None:
    fold = BatchFold("batch_1")
    assert fold.apply(expanded(3)) and fold.status == "in_progress" and fold.tenant == "acme"
    assert fold.apply(event("result", "batch_1-1", 200, item="b"))
    assert not fold.apply(event("result", "batch_1-1", 200, item="b"))  # a redelivery
    assert fold.apply(event("result", "batch_1-0", 400, item="a"))
    assert not fold.all_ended()
    fold.apply(event("result", "batch_1-2", 200, item="c"))
    assert fold.all_ended()
    assert fold.counts() == {"total": 3, "completed": 2, "failed": 1}
    ok, failed = fold.output_lines()
    assert [json.loads(x)["custom_id"] for x in ok] == ["b", "c"]  # in line order
    assert json.loads(failed[0])["response"]["status_code"] == 400
    assert json.loads(failed[0])["response"]["body"]["error"]["message"] == "bad"
    fold.finish("completed", 2_000_000, "file-out", "file-err")
    obj = fold.object()
    assert obj["status"] == "completed" and obj["output_file_id"] == "file-out"
    assert obj["in_progress_at"] == 1000 and obj["completed_at"] == 2000
    assert not fold.apply(event("result", "batch_1-9", 200))  # final: nothing changes


def test_an_invalid_batch_fails_with_its_errors() -> None:
    fold = BatchFold("batch_1")
    errors = [{"code": "invalid_json_line", "line": 2, "message": "x", "param": None}]
    fold.apply(event("invalid", detail={"object": {"id": "batch_1"}, "errors": errors}))
    assert fold.final and fold.object()["errors"] == {"object": "list", "data": errors}


def test_a_cancelled_batch_leaves_out_what_the_cancel_stopped() -> None:
    fold = BatchFold("batch_1")
    fold.apply(expanded(3))
    fold.apply(event("result", "batch_1-0", 200, item="a"))
    fold.apply(event("cancel"))
    assert fold.status == "cancelling"
    fold.apply(event("result", "batch_1-1", 499, item="b"))
    assert fold.counts() == {"total": 3, "completed": 1, "failed": 0}
    assert len(fold.output_lines()[0]) == 1


def test_a_background_response_completes_with_its_text_and_usage() -> None:
    fold = ResponseFold("resp_1")
    fold.apply(event("expanded", job="resp_1",
                     detail={"object": {"id": "resp_1", "object": "response",
                                        "status": "queued"}, "total": 1, "tenant": "t"}))
    assert fold.status == "in_progress"
    fold.apply(event("result", "resp_1", 200, text="Paris.", finish="stop", job="resp_1"))
    obj = fold.object()
    assert fold.final and obj["status"] == "completed"
    assert obj["output"][0]["content"][0]["text"] == "Paris."
    assert obj["usage"]["total_tokens"] == 5


def test_a_response_cut_by_max_tokens_is_incomplete_and_a_cancel_cancels() -> None:
    fold = ResponseFold("resp_1")
    fold.apply(event("result", "resp_1", 200, text="a", finish="length", job="resp_1"))
    assert fold.object()["incomplete_details"] == {"reason": "max_output_tokens"}
    other = ResponseFold("resp_2")
    other.apply(event("cancel", job="resp_2"))
    assert other.final and other.object()["status"] == "cancelled"

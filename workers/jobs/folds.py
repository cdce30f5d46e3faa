"""A job's state folded from its events on ``conveyor.results``:
:class:`BatchFold`, the OpenAI ``Batch`` it shows (validating -> in_progress
-> finalizing -> completed; failed, cancelling -> cancelled, expired), and
:class:`ResponseFold`, a background response (queued -> in_progress ->
completed, incomplete, failed or cancelled). ``invalid`` fails only a job not
started; the first result per request id counts (docs/api/jobs.md)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from schemas.openai.chunks import compact_json
from schemas.openai.response_items import output_items
from schemas.openai.responses import response_usage
from schemas.records import JobResult

__all__ = ["BatchFold", "FINAL", "ResponseFold"]


FINAL = ("completed", "failed", "cancelled", "expired")


def _s(ms: int) -> int:
    return ms // 1000


@dataclass
class _Fold:
    """What both folds share: the job's object as created, its status and tenant."""

    job_id: str
    base: dict[str, Any] = field(default_factory=dict)  # the object as created
    status: str = ""
    last_event_ms: int = 0
    tenant: str = ""
    ends: ClassVar[tuple[str, ...]]  # the final statuses

    @property
    def final(self) -> bool:
        return self.status in self.ends

    def _opened(self, event: JobResult, first: str) -> dict[str, Any] | None:
        """The common start of ``apply``: None when ``event`` changes nothing
        (the job is final, or ``invalid`` after its ``first`` status), else its
        detail, the object and tenant taken from ``expanded`` and ``invalid``."""
        self.last_event_ms = max(self.last_event_ms, event["ts_ms"])
        if self.final or (event["event"] == "invalid" and self.status != first):
            return None  # an invalid job that started already ends with its results
        if event["event"] not in ("expanded", "invalid"):
            return {}
        detail: dict[str, Any] = json.loads(event["detail"] or "{}")
        self.base = detail.get("object", self.base)
        self.tenant = detail.get("tenant", self.tenant)
        return detail


@dataclass
class BatchFold(_Fold):
    ends: ClassVar[tuple[str, ...]] = FINAL
    status: str = "validating"
    total: int = 0
    results: dict[str, JobResult] = field(default_factory=dict)  # request id -> first
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at ... (seconds)
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None

    def apply(self, event: JobResult) -> bool:
        """Fold one event; True when the visible state changed."""
        detail = self._opened(event, "validating")
        if detail is None:
            return False
        kind = event["event"]
        if kind in ("expanded", "invalid"):
            if kind == "invalid":
                self.errors = detail.get("errors", [])
                self._to("failed", event["ts_ms"])
                return True
            if self.status == "validating":
                self.total = int(detail.get("total", 0))
                self._to("in_progress", event["ts_ms"])
            return True
        if kind == "cancel":
            if self.status in ("validating", "in_progress"):
                self._to("cancelling", event["ts_ms"])
                return True
            return False
        if event["request_id"] in self.results:
            return False
        self.results[event["request_id"]] = event
        return True

    def _to(self, status: str, ts_ms: int) -> None:
        self.status = status
        self.times.setdefault(f"{status}_at", _s(ts_ms))

    def all_ended(self) -> bool:
        return self.status in ("in_progress", "cancelling") and self.total > 0 and \
            len(self.results) >= self.total

    def ran(self) -> list[JobResult]:
        """The results of requests that ran (not stopped by the cancel), in line order."""
        done = [r for r in self.results.values() if r["status_code"] != 499]
        return sorted(done, key=lambda r: _line_of(r["request_id"]))

    def counts(self) -> dict[str, int]:
        ran = [r for r in self.results.values() if r["status_code"] != 499]
        ok = sum(1 for r in ran if r["status_code"] == 200)
        return {"total": self.total, "completed": ok, "failed": len(ran) - ok}

    def finish(self, status: str, now_ms: int, output_file_id: str | None,
               error_file_id: str | None) -> None:
        """Into a final status, with the files written for it."""
        self.times.setdefault("finalizing_at", _s(now_ms))
        self.output_file_id = output_file_id
        self.error_file_id = error_file_id
        self._to(status, now_ms)

    def object(self) -> dict[str, Any]:
        """The OpenAI ``Batch`` as a client reads it."""
        out: dict[str, Any] = dict(self.base) if self.base else {"id": self.job_id,
                                                                  "object": "batch"}
        out.update({"status": self.status, "request_counts": self.counts(),
                    "output_file_id": self.output_file_id,
                    "error_file_id": self.error_file_id})
        if self.errors is not None:
            out["errors"] = {"object": "list", "data": self.errors}
        for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                     "expired_at", "cancelling_at", "cancelled_at"):
            out[name] = self.times.get(name)
        return out

    def output_lines(self) -> tuple[list[str], list[str]]:
        """The output file's lines (answered requests) and the error file's
        (requests that failed), as OpenAI writes them."""
        ok: list[str] = []
        failed: list[str] = []
        for r in self.ran():
            if r["status_code"] == 200:
                body: Any = json.loads(r["body"]) if r["body"] else {}
            else:
                error = r["error"] or {"message": "The request failed.", "type": "server_error",
                                       "param": None, "code": None}
                body = {"error": {k: error.get(k) for k in ("message", "type", "param",
                                                             "code")}}
            line = {"id": f"batch_req_{r['request_id'].rsplit('-', 1)[-1]}_{self.job_id[6:]}",
                    "custom_id": r["job_item"],
                    "response": {"status_code": r["status_code"],
                                 "request_id": r["request_id"], "body": body},
                    "error": None}
            text = compact_json(line)
            (ok if r["status_code"] == 200 else failed).append(text)
        return ok, failed


def _line_of(request_id: str) -> int:
    tail = request_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


@dataclass
class ResponseFold(_Fold):
    ends: ClassVar[tuple[str, ...]] = ("completed", "incomplete", "failed", "cancelled")
    status: str = "queued"
    result: JobResult | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # why it was invalid

    def apply(self, event: JobResult) -> bool:
        detail = self._opened(event, "queued")
        if detail is None:
            return False
        kind = event["event"]
        if kind == "expanded":
            if self.status == "queued":
                self.status = "in_progress"
            return True
        if kind == "invalid":
            self.status = "failed"
            errors = detail.get("errors") or []
            self.errors = [e for e in errors if isinstance(e, dict)]
            return True
        if kind == "cancel":
            self.status = "cancelled"
            return True
        self.result = event
        if event["status_code"] == 499:
            self.status = "cancelled"
        elif event["status_code"] != 200:
            self.status = "failed"
        elif event["finish_reason"] == "length":
            self.status = "incomplete"
        else:
            self.status = "completed"
        return True

    def object(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.base) if self.base else {"id": self.job_id,
                                                                  "object": "response"}
        out["status"] = self.status
        result = self.result
        if result is not None and result["status_code"] in (200, 499) and result["text"]:
            # with function tools (echoed in the base object) the text holds calls
            reads_calls = bool(out.get("tools")) and out.get("tool_choice") != "none"
            out["output"] = output_items(
                self.job_id, result["text"], reads_calls,
                "completed" if self.status == "completed" else "incomplete")
        if result is not None and result["usage"] is not None:
            out["usage"] = response_usage(result["usage"])
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.status == "failed":
            error: dict[str, Any] = dict((result["error"] if result is not None else None)
                                         or (self.errors[0] if self.errors else {}))
            out["error"] = {"code": error.get("code") or "server_error",
                            "message": error.get("message") or "The response failed."}
        if self.final and self.status != "cancelled":
            out.setdefault("completed_at", int(time.time()))
        return out

"""One background response's state, folded from its events on
``conveyor.results``: queued -> in_progress -> completed (or incomplete,
failed, cancelled). The object is the Response the gateway built when it took
the request, with status, output, usage and error filled in as it ends. An
``invalid`` event fails a response still queued, with its first error; once
the request runs, the response ends with the request's result."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from schemas.openai.response_items import output_items
from schemas.openai.responses import response_usage
from schemas.records import JobResult

__all__ = ["ResponseFold"]

_FINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class ResponseFold:
    job_id: str
    base: dict[str, Any] = field(default_factory=dict)
    status: str = "queued"
    result: JobResult | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # why it was invalid
    last_event_ms: int = 0
    tenant: str = ""

    @property
    def final(self) -> bool:
        return self.status in _FINAL

    def apply(self, event: JobResult) -> bool:
        self.last_event_ms = max(self.last_event_ms, event["ts_ms"])
        if self.final:
            return False
        kind = event["event"]
        if kind == "invalid" and self.status != "queued":
            return False  # its request runs already: it ends with its result
        if kind in ("expanded", "invalid"):
            detail = json.loads(event["detail"] or "{}")
            self.base = detail.get("object", self.base)
            self.tenant = detail.get("tenant", self.tenant)
        if kind == "expanded":
            if self.status == "queued":
                self.status = "in_progress"
            return True
        if kind == "invalid":
            self.status = "failed"
            errors = json.loads(event["detail"] or "{}").get("errors") or []
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

    def all_ended(self) -> bool:
        return False  # a response ends with its one result: apply() makes it final

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

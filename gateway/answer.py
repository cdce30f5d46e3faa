"""One submitted request's answer as the gateway reads it: its replies, with
the request's deadline, and what is done when it is closed (the generation
cancelled if unfinished, the admission settled, the access-log line and the
request's metrics written)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from conveyor.errors import DeadlineExceeded
from conveyor.tracing import GENAI_OPERATIONS
from gateway.admission import FREE, Ticket
from gateway.pii import ReplyRestorer
from gateway.replies import ReplyStream, reply_error
from schemas.records import Reply, Usage

if TYPE_CHECKING:
    from gateway.serving import Serving

__all__ = ["Answer"]

access_log = logging.getLogger("conveyor.access")



class Answer:
    """The replies of one submitted request, read with its deadline; when it is
    closed it writes the request's access-log line."""

    def __init__(self, serving: Serving, stream: ReplyStream, deadline: float,
                 access: dict[str, Any] | None = None, ticket: Ticket = FREE,
                 restorer: ReplyRestorer | None = None) -> None:
        self.serving = serving
        self.restorer = restorer  # personal data put back (gateway/pii.py)
        # the prompt cache: "" not asked, "miss", or "hit" once a reply says so
        self.cache = ""
        self.ticket = ticket
        self.produced = False  # a token (or the end) reached us: the generation ran
        self.stream = stream
        self.deadline = deadline
        self.finished = False
        self.started = time.monotonic()
        self.first_at: float | None = None
        self.status: int | None = None
        self.usage: Usage | None = None
        self.access = access or {}
        self._logged = False

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    async def next(self, within: float | None = None) -> Reply | None:
        """The next reply; None when ``within`` seconds passed first; 504 past the deadline."""
        try:
            if self.deadline <= time.monotonic():  # past it, even with a reply waiting
                raise DeadlineExceeded("The request did not finish within its deadline.")
            reply = await self.stream.next(self.deadline, within)
        except DeadlineExceeded:
            self.status = DeadlineExceeded.status
            raise
        if reply is None:
            return None
        if self.first_at is None:
            self.first_at = time.monotonic()
        if reply["kind"] == "error":
            self.finished = True
            err = reply["error"]
            self.status = err["status"] if err is not None else 500
            raise reply_error(reply)
        self.produced = True
        if reply.get("cached"):
            self.cache = "hit"
        if self.restorer is not None:
            reply = self.restorer.apply(reply)
        if reply["kind"] == "final":
            self.finished = True
            self.status = 200
            self.usage = reply["usage"]
        return reply

    @property
    def cache_headers(self) -> dict[str, str]:
        """``x-conveyor-cache: hit|miss`` where the prompt cache was asked."""
        return {"x-conveyor-cache": self.cache} if self.cache else {}

    def close(self, reason: str, grace_s: float = 0.0) -> None:
        """Stop reading; an unfinished generation is cancelled, after ``grace_s``
        unless a resumed stream reads it by then."""
        self.serving.router.close(self.request_id)
        if not self.finished:
            self.finished = True
            self.serving.cancel(self.request_id, reason, grace_s=grace_s)
        self.ticket.settle(self.usage, self.produced)
        if not self._logged:
            self._logged = True
            self._log_access()

    def _log_access(self) -> None:
        """One line a request: what, how it ended, how long; a hash of the prompt,
        never the prompt. Status 499: the client went away first."""
        now = time.monotonic()
        self._measure(now)
        usage = self.usage or {"prompt_tokens": 0, "completion_tokens": 0}
        ttft = (self.first_at - self.started) * 1000 if self.first_at else float("nan")
        access_log.info(
            "request=%s tenant=%s key=%s model=%s kind=%s stream=%s status=%d ttft_ms=%.1f "
            "total_ms=%.1f prompt_tokens=%d completion_tokens=%d prompt_sha256=%s trace=%s",
            self.request_id, self.access.get("tenant", ""), self.access.get("key", ""),
            self.access.get("model", ""),
            self.access.get("kind", ""), self.access.get("stream", ""), self.status or 499,
            ttft, (now - self.started) * 1000, usage["prompt_tokens"],
            usage["completion_tokens"], self.access.get("prompt_sha256", ""),
            self.access.get("trace", ""))

    def _measure(self, now: float) -> None:
        usage = self.usage
        self.serving.metrics.request_ended(
            status=self.status or 499, model=self.access.get("model", ""),
            tenant=self.access.get("tenant", ""), operation=GENAI_OPERATIONS.get(
                self.access.get("kind", ""), "chat"),
            started=self.started, first_at=self.first_at, ended=now,
            input_tokens=usage["prompt_tokens"] if usage else None,
            output_tokens=usage["completion_tokens"] if usage else None)

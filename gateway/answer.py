"""One submitted request's answer as the gateway reads it: its replies, with
the request's deadline, and what is done when it is closed (the generation
cancelled if unfinished, the admission settled, the access-log line and the
request's metrics written)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from conveyor.errors import DeadlineExceeded
from conveyor.metrics import GatewayMetrics
from conveyor.settings import GatewaySettings
from gateway.admission import FREE, Ticket
from gateway.cancels import Cancels
from gateway.pii import ReplyRestorer
from gateway.replies import Folded, ReplyRouter, ReplyStream, fold_answer, reply_error
from schemas.openai.chunks import full_response
from schemas.openai.logprobs import asks_logprobs
from schemas.records import Generation, Reply, Usage
from schemas.tools import reads_tool_calls
from topics.tracing import GENAI_OPERATIONS

__all__ = ["Answer", "Disconnected", "answer_object", "collect"]

access_log = logging.getLogger("conveyor.access")

Disconnected = Callable[[], Awaitable[bool]]

# how often a request still waiting for its first reply checks its client
_DISCONNECT_POLL_S = 0.5


class Answer:
    """The replies of one submitted request, read with its deadline; when it is
    closed it writes the request's access-log line."""

    def __init__(self, stream: ReplyStream, deadline: float, router: ReplyRouter,
                 cancels: Cancels, metrics: GatewayMetrics | None = None,
                 access: dict[str, Any] | None = None, ticket: Ticket = FREE,
                 restorer: ReplyRestorer | None = None) -> None:
        self.router = router  # whose stream this is: closed with the answer
        self.cancels = cancels
        self.metrics = metrics or GatewayMetrics.off()
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

    async def first(self, disconnected: Disconnected) -> Reply | None:
        """The first reply, before the response status is chosen; None when the
        client left first (its request is cancelled at once, wherever it waits:
        queued behind busy workers, say, not only once a worker takes it)."""
        try:
            while True:
                reply = await self.next(within=_DISCONNECT_POLL_S)
                if reply is not None:
                    return reply
                if await disconnected():
                    self.close("client disconnected before the first token")
                    return None
        except BaseException:
            self.close("failed before the first token")
            raise

    async def fold(self, disconnected: Disconnected) -> Folded | None:
        """The whole answer, read to its end (None when the client left first); the
        answer is closed after."""
        try:
            folded = await fold_answer(self, within=1.0, idle=disconnected)
            if folded is None:
                self.close("client disconnected")
            return folded
        finally:
            self.close("gateway stopped waiting")

    @property
    def cache_headers(self) -> dict[str, str]:
        """``x-conveyor-cache: hit|miss`` where the prompt cache was asked."""
        return {"x-conveyor-cache": self.cache} if self.cache else {}

    def close(self, reason: str, grace_s: float = 0.0) -> None:
        """Stop reading; an unfinished generation is cancelled, after ``grace_s``
        unless a resumed stream reads it by then."""
        self.router.close(self.request_id)
        if not self.finished:
            self.finished = True
            self.cancels.cancel(self.request_id, reason, grace_s=grace_s)
        self.ticket.settle(self.usage, self.produced)
        if not self._logged:
            self._logged = True
            self._log_access()

    async def relay(self, frames: AsyncIterator[bytes], gateway: GatewaySettings
                    ) -> AsyncIterator[bytes]:
        """``frames``, then the answer closed. Closed early (the client went
        away), the generation is cancelled after ``resume_grace_s`` when streams
        are resumable, unless a resumed stream reads it by then."""
        ended = False
        try:
            async for frame in frames:
                yield frame
            ended = True
        finally:
            resumable = gateway.resumable_streams and not ended
            self.close("client disconnected",
                       grace_s=gateway.resume_grace_s if resumable else 0.0)

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
        self.metrics.request_ended(
            status=self.status or 499, model=self.access.get("model", ""),
            tenant=self.access.get("tenant", ""), operation=GENAI_OPERATIONS.get(
                self.access.get("kind", ""), "chat"),
            started=self.started, first_at=self.first_at, ended=now,
            input_tokens=usage["prompt_tokens"] if usage else None,
            output_tokens=usage["completion_tokens"] if usage else None)


async def collect(generation: Generation, answer: Answer,
                  disconnected: Disconnected) -> dict[str, Any]:
    """The whole answer as chat/completions' object ({} when the client left first)."""
    folded = await answer.fold(disconnected)
    if folded is None:
        return {}
    return answer_object(generation, answer.request_id, folded,
                         folded.model or generation["model"])


def answer_object(generation: Generation, request_id: str, folded: Folded,
                  model: str) -> dict[str, Any]:
    """A whole answer as chat/completions' object, naming ``model`` as its answerer."""
    return full_response(generation["kind"], model, generation["created"], request_id,
                         folded.text, folded.finish_reason, folded.usage,
                         tool_calls=reads_tool_calls(generation),
                         logprobs=folded.logprobs if asks_logprobs(generation) else None)

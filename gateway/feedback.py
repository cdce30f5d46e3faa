"""``POST /v1/feedback``: a client's rating of one answer, kept on
``conveyor.feedback`` (key = request id); the contract is
docs/api/feedback.md. Only the request's tenant may rate it (else 404). The
event carries the model asked for, the model that answered and the latency,
read from the log when the rating comes; the latest rating counts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from conveyor.errors import RequestError
from gateway.auth.middleware import identity_of
from gateway.errors import NotFound, SafeJSONResponse
from gateway.publisher import Publisher
from gateway.resume import StreamNotFound, request_id_of
from gateway.services import service
from gateway.stored import StoredAnswers
from schemas.openai.feedback import FeedbackBody
from schemas.records import Feedback
from topics.catalog import FEEDBACK

__all__ = ["feedback_router"]

feedback_router = APIRouter()


# how long a rating waits for the answer it rates to end (it is kept either way)
_ANSWER_WAIT_S = 2.0


class RequestNotFound(NotFound):
    """404 for a request that is not in the log, or is not the caller's."""

    def __init__(self, named: str) -> None:
        super().__init__(f"No request found with id '{named}'.", param="request_id")


@feedback_router.post("/v1/feedback", response_model=None)
async def feedback(body: FeedbackBody, request: Request,
                   stored: Annotated[StoredAnswers, Depends(service("stored"))],
                   publisher: Annotated[Publisher, Depends(service("publisher"))]
                   ) -> SafeJSONResponse:
    """Rate an answer (see the module)."""
    identity = identity_of(request)
    named = body.request_id.removeprefix("resp_")  # whichever id of it the client holds
    try:
        rid = request_id_of(named)
    except StreamNotFound:
        raise RequestNotFound(named) from None
    where = await stored.locate(rid)
    if where is None or not stored.mine(where, identity):
        raise RequestNotFound(body.request_id)
    answered_by, latency_ms = "", None
    with contextlib.suppress(RequestError, TimeoutError):
        folded, ended_ms = await asyncio.wait_for(stored.read(where), _ANSWER_WAIT_S)
        answered_by = folded.model or where.generation["model"]
        if ended_ms is not None:
            latency_ms = max(0, ended_ms - where.submitted_ms)
    now_ms = int(time.time() * 1000)
    event = Feedback(request_id=rid, tenant=where.tenant, key_id=identity.key_id,
                     score=float(body.score), labels=list(body.labels), comment=body.comment,
                     model=where.generation["model"], answered_by=answered_by,
                     latency_ms=latency_ms, ts_ms=now_ms)
    await publisher.publish(FEEDBACK, event, rid, what="the feedback")
    out: dict[str, Any] = {"object": "feedback", "request_id": rid, "score": event["score"],
                           "labels": event["labels"], "comment": event["comment"],
                           "model": event["model"], "answered_by": answered_by,
                           "latency_ms": latency_ms, "created_at": now_ms // 1000}
    return SafeJSONResponse(out)

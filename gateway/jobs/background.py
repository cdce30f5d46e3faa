"""Background responses (``POST /v1/responses`` with ``background: true``): a job,
taken at once as ``queued`` (its first state to ``conveyor.job-status``, its
``create`` command to ``conveyor.jobs``), admitted against the caller's limits
(the reservation kept), read back from the :class:`~gateway.jobs.board.JobBoard`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from conveyor.errors import InvalidRequest
from conveyor.policy.rules import PolicyBook
from conveyor.settings import Settings
from gateway.admission import Admitter
from gateway.auth.types import Identity
from gateway.jobs.board import JobBoard, JobDesk
from gateway.publisher import Publisher
from gateway.responses.objects import new_response_id, response_object
from schemas.openai.responses import ResponsesRequest
from schemas.records import Generation
from topics.catalog import JOBS
from topics.envelope import now_ms
from workers.policy_checks import redacted

__all__ = ["BackgroundResponses"]

_RUNNING = ("queued", "in_progress")


class BackgroundResponses(JobDesk):
    kind = "response"
    missing = "Response with id '{}' not found."

    def __init__(self, settings: Settings, publisher: Publisher, board: JobBoard,
                 admitter: Admitter | None = None, policies: PolicyBook | None = None) -> None:
        super().__init__(settings, publisher, board)
        self.policies = policies or PolicyBook()
        self.admitter = admitter

    async def create(self, identity: Identity, body: ResponsesRequest,
                     generation: Generation) -> dict[str, Any]:
        if body.stream:
            raise InvalidRequest("A background response cannot be streamed here; retrieve "
                                 "it with GET /v1/responses/{id}.", param="stream")
        request_id = uuid.uuid4().hex
        response_id = new_response_id(request_id)
        if self.admitter is not None:
            ticket = await self.admitter.admit(identity, generation, response_id,
                                               now_ms() + 24 * 3600 * 1000)
            ticket.settle(None, produced=True)
        obj = response_object(response_id, int(time.time()), body, "queued")
        policy = self.policies.effective(identity.tenant, identity.key_id)
        if policy.redact:  # before the command and its status are written (gateway/pii.py)
            generation, redactor = await redacted(generation, policy)
            if isinstance(obj.get("instructions"), str):
                obj["instructions"] = redactor.redact(obj["instructions"])
        await self.open(identity, response_id, obj, self.command(
            identity, response_id, "create", "/v1/responses", generation=generation,
            body=json.dumps(obj)))
        return obj

    async def cancel(self, identity: Identity, response_id: str) -> dict[str, Any]:
        obj = await self.retrieve(identity, response_id)
        if obj["status"] == "cancelled":
            return obj
        if obj["status"] not in _RUNNING:
            raise self.not_cancellable(obj["status"])
        await self.publisher.publish(JOBS, self.command(identity, response_id, "cancel",
                                                        "/v1/responses"),
                                     response_id, what="the response's cancel")
        return {**obj, "status": "cancelled"}

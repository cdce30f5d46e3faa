"""Background responses (``POST /v1/responses`` with ``background: true``): a job,
taken at once as ``queued`` (its first state to ``conveyor.job-status``, its
``create`` command to ``conveyor.jobs``), admitted against the caller's limits
(the reservation kept), read back from the :class:`~gateway.jobs.board.JobBoard`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from conveyor.errors import InvalidRequest, RequestError
from conveyor.policy.rules import PolicyBook
from conveyor.settings import Settings
from gateway.auth.types import Identity
from gateway.jobs.board import JobBoard
from gateway.publisher import Publisher
from gateway.responses.objects import new_response_id, response_object
from schemas.openai.responses import ResponsesRequest
from schemas.records import Generation, JobCommand, JobStatus
from topics.catalog import JOB_STATUS, JOBS
from topics.envelope import now_ms
from workers.policy_checks import redacted

__all__ = ["BackgroundResponses"]

_RUNNING = ("queued", "in_progress")


class BackgroundResponses:
    def __init__(self, settings: Settings, publisher: Publisher, board: JobBoard,
                 admitter: Any = None, policies: PolicyBook | None = None) -> None:
        self.settings = settings
        self.policies = policies or PolicyBook()
        self.publisher = publisher
        self.board = board
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
        status = JobStatus(job_id=response_id, kind="response", tenant=identity.tenant,
                           version=0, ts_ms=now_ms(), object=json.dumps(obj))
        command = JobCommand(job_id=response_id, kind="response", action="create",
                             tenant=identity.tenant, key_id=identity.key_id, ts_ms=now_ms(),
                             input_file_id="", endpoint="/v1/responses", completion_window="",
                             metadata={}, generation=generation, models=[],
                             body=json.dumps(obj))
        await self.publisher.publish(JOB_STATUS, status, response_id, what="the response")
        await self.publisher.publish(JOBS, command, response_id, what="the response")
        self.board.put(status)
        return obj

    async def retrieve(self, identity: Identity, response_id: str) -> dict[str, Any]:
        obj = await self.board.get(identity.tenant, response_id, "response")
        if obj is None:
            raise RequestError(f"Response with id '{response_id}' not found.", status=404,
                               type="invalid_request_error", code="not_found")
        return obj

    async def cancel(self, identity: Identity, response_id: str) -> dict[str, Any]:
        obj = await self.retrieve(identity, response_id)
        if obj["status"] == "cancelled":
            return obj
        if obj["status"] not in _RUNNING:
            raise RequestError(f"Cannot cancel a response that is {obj['status']}.",
                               status=409, type="invalid_request_error", code=None)
        command = JobCommand(job_id=response_id, kind="response", action="cancel",
                             tenant=identity.tenant, key_id=identity.key_id, ts_ms=now_ms(),
                             input_file_id="", endpoint="/v1/responses", completion_window="",
                             metadata={}, generation=None, models=[], body="")
        await self.publisher.publish(JOBS, command, response_id,
                                     what="the response's cancel")
        return {**obj, "status": "cancelled"}

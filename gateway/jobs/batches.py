"""The Batch API at the gateway: create, retrieve, list and cancel batches.
Creating checks what can be checked at once (the input file is the tenant's,
for batches; the endpoint and window are served), writes the first state and
the ``create`` command (503 when Kafka does not take them in time) and answers
the Batch object; the jobs layers do the rest, the
:class:`~gateway.jobs.board.JobBoard` serves the states."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from conveyor.errors import InvalidRequest, RequestError
from conveyor.settings import Settings
from gateway.auth.types import Identity
from gateway.jobs.board import JobBoard, JobDesk
from gateway.publisher import Publisher
from topics.catalog import JOBS

__all__ = ["Batches", "BatchCreateRequest", "page"]

_WINDOW_S = 24 * 3600
_CANCELLABLE = ("validating", "in_progress")


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None

    def check(self) -> None:
        if self.endpoint not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            raise InvalidRequest("endpoint must be /v1/chat/completions, /v1/completions or "
                                 "/v1/embeddings.", param="endpoint")
        if self.completion_window != "24h":
            raise InvalidRequest("completion_window must be 24h.", param="completion_window")
        if self.metadata is not None and (
                len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                               for k, v in self.metadata.items())):
            raise InvalidRequest("metadata takes at most 16 pairs, keys of at most 64 and "
                                 "values of at most 512 characters.", param="metadata")


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page over ``items``, in the order given (batches list
    newest first); ``after`` is the id of the last item the client has."""
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100.", param="limit")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


class Batches(JobDesk):
    kind = "batch"
    missing = "No batch found with id '{}'."

    def __init__(self, settings: Settings, publisher: Publisher, board: JobBoard,
                 files: Any) -> None:
        super().__init__(settings, publisher, board)
        self.files = files

    async def create(self, identity: Identity, body: BatchCreateRequest) -> dict[str, Any]:
        body.check()
        try:
            source = await self.files.get(identity.tenant, body.input_file_id)
        except RequestError:
            raise InvalidRequest(f"No file with id {body.input_file_id!r}.",
                                 param="input_file_id") from None
        if getattr(source, "purpose", "batch") != "batch":
            raise InvalidRequest("The input file must be uploaded with purpose batch.",
                                 param="input_file_id")
        created = int(time.time())
        batch: dict[str, Any] = {
            "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body.endpoint,
            "errors": None, "input_file_id": body.input_file_id,
            "completion_window": body.completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created,
            "in_progress_at": None, "expires_at": created + _WINDOW_S, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.metadata}
        await self.open(identity, batch["id"], batch, self.command(
            identity, batch["id"], "create", body.endpoint, input_file_id=body.input_file_id,
            completion_window=body.completion_window, metadata=body.metadata,
            models=sorted(identity.models or ()), body=json.dumps(batch)))
        return batch

    def listing(self, identity: Identity, after: str | None, limit: int) -> dict[str, Any]:
        return page(self.board.listing(identity.tenant, "batch"), after, limit)

    async def cancel(self, identity: Identity, batch_id: str) -> dict[str, Any]:
        batch = await self.retrieve(identity, batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in _CANCELLABLE:
            raise self.not_cancellable(batch["status"])
        command = self.command(identity, batch_id, "cancel", batch["endpoint"],
                               input_file_id=batch["input_file_id"],
                               completion_window=batch["completion_window"],
                               models=sorted(identity.models or ()))
        await self.publisher.publish(JOBS, command, batch_id, what="the batch's cancel")
        return {**batch, "status": "cancelling", "cancelling_at": int(time.time())}

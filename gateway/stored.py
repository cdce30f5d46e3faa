"""Stored answers, read back by id from the log (docs/api/chat.md#stored-answers):
the request event records ``store`` and the metadata, the replies are in the
reply log; a read finds the event as a resume does and folds the replies, on
any replica. Only the tenant, through the API that created it (else 404); an
answer still running is waited for up to its deadline."""

from __future__ import annotations

from typing import Any, Literal

from conveyor.errors import RequestError
from conveyor.settings import Settings
from gateway.answer import answer_object
from gateway.auth.types import Identity
from gateway.errors import NotFound
from gateway.jobs.batches import page
from gateway.replies import Folded, fold_answer
from gateway.resume import (
    Recorded,
    RecordedReplies,
    StreamNotFound,
    locate,
    request_id_of,
)
from schemas.codec import Codec
from topics.lookup import SharedLookup

__all__ = ["CompletionNotFound", "StoredAnswers"]


class CompletionNotFound(NotFound):
    """404 for a chat completion that was not stored, or is not the caller's."""

    def __init__(self, completion_id: str, why: str = "") -> None:
        super().__init__(f"No stored chat completion found with id '{completion_id}'."
                         + (f" {why}" if why else ""), param="completion_id")


class StoredAnswers:
    """Requests and their answers as the log records them, found by id through
    the gateway's one keyed lookup (the lifespan closes it)."""

    def __init__(self, settings: Settings, lookup: SharedLookup, codec: Codec) -> None:
        self.settings = settings
        self.lookup = lookup
        self.codec = codec

    async def locate(self, request_id: str, of_job: bool = False,
                     since_ms: int | None = None) -> Recorded | None:
        """The request's recorded address (:func:`gateway.resume.locate`)."""
        return await locate(self.lookup, request_id, of_job=of_job, since_ms=since_ms)

    def mine(self, where: Recorded, identity: Identity) -> bool:
        """Whether the caller may see the request: its tenant's (any, without auth)."""
        return self.settings.auth.mode == "none" or where.tenant == identity.tenant

    async def find(self, identity: Identity, request_id: str, api: str) -> Recorded | None:
        """The recorded request ``request_id`` when ``api`` stored it and it is the
        caller's."""
        where = await self.locate(request_id)
        if where is None:
            return None
        generation = where.generation
        if not generation.get("store", False) or generation.get("api") != api:
            return None
        return where if self.mine(where, identity) else None

    async def read(self, where: Recorded) -> tuple[Folded, int | None]:
        """The recorded answer (waited for, up to its deadline) and when it ended
        (epoch milliseconds of its final reply); an error reply raises."""
        replies = RecordedReplies(self.settings, self.codec, where)
        replies.start()
        try:
            folded = await fold_answer(replies)
        finally:
            await replies.close()
        assert folded is not None  # no idle callback: only the final reply ends it
        return folded, replies.ended_ms

    async def chat_completion(self, identity: Identity, completion_id: str) -> dict[str, Any]:
        """The ``chat.completion`` a stored request answered."""
        where = await self._stored_chat(identity, completion_id)
        try:
            folded, _ = await self.read(where)
        except RequestError as exc:
            raise CompletionNotFound(completion_id, f"It ended in an error and holds no "
                                                    f"answer: {exc.message}") from None
        return answer_object(where.generation, where.request_id, folded,
                             where.generation["model"])

    async def messages(self, identity: Identity, completion_id: str, after: str | None,
                       limit: int, order: Literal["asc", "desc"]) -> dict[str, Any]:
        """The messages a stored chat completion was asked with, as OpenAI pages them."""
        where = await self._stored_chat(identity, completion_id)
        stem = f"chatcmpl-{where.request_id}"
        items: list[dict[str, Any]] = [
            {"id": f"{stem}-{index}", "role": m["role"], "content": m["content"],
             "name": m.get("name"), "content_parts": None}
            for index, m in enumerate(where.generation["messages"])]
        if order == "desc":
            items.reverse()
        return page(items, after, limit)

    async def _stored_chat(self, identity: Identity, completion_id: str) -> Recorded:
        try:
            rid = request_id_of(completion_id, "chat")
        except StreamNotFound:
            raise CompletionNotFound(completion_id) from None
        where = await self.find(identity, rid, "chat.completions")
        if where is None:
            raise CompletionNotFound(completion_id)
        return where

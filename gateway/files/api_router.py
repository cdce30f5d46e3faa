"""The Files API routes (OpenAI's ``/v1/files``); they only dispatch, and serve the
caller's own tenant. ``POST /v1/files`` takes up to ``max_file_bytes`` plus
:data:`MULTIPART_ALLOWANCE` (:func:`upload_limits`, for
:class:`~gateway.limits.BodyLimit`) and streams unbuffered: the form parser
spools the file part (in memory up to 1 MiB, then on disk), from which it is
checked and copied into the store chunk by chunk, never held in memory."""

from __future__ import annotations

from typing import Annotated, Any, cast, get_args

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from conveyor.errors import InvalidRequest
from conveyor.files.local import LocalFileStore
from conveyor.files.store import LIST_LIMIT_MAX, FileOrder, is_file_id
from conveyor.settings import JobsSettings
from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.files.uploads import upload
from gateway.openapi import error
from gateway.services import service
from schemas.openai.files import (
    FileDeleted,
    FileList,
    OpenAIFile,
    deleted_json,
    file_json,
    page_json,
)

__all__ = ["files_router", "upload_limits", "UPLOAD_PATH", "MULTIPART_ALLOWANCE"]

files_router = APIRouter()

UPLOAD_PATH = "/v1/files"
# room in an upload's body for the multipart framing around the file (boundaries,
# part headers, the purpose field); the file itself is held to max_file_bytes exactly
MULTIPART_ALLOWANCE = 64 * 1024


Files = Annotated[LocalFileStore, Depends(service("files"))]


def upload_limits(jobs: JobsSettings) -> dict[str, int]:
    """The body limits of the upload paths, for :class:`~gateway.limits.BodyLimit`."""
    return {UPLOAD_PATH: jobs.max_file_bytes + MULTIPART_ALLOWANCE}


_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: error("No such file of the caller's tenant (code file_not_found).")}
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSON Lines: one batch request object per line."},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}}
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


@files_router.post(UPLOAD_PATH, response_model=OpenAIFile, openapi_extra=_UPLOAD_BODY,
                   responses={400: error("A purpose other than batch, an empty file, or a "
                                          "line that is not a JSON object (named)."),
                              413: error("The file is larger than max_file_bytes "
                                          "(code request_too_large).")})
async def create_file(request: Request, store: Files
                      ) -> SafeJSONResponse:
    tenant = identity_of(request).tenant
    async with request.form(max_files=1, max_fields=16) as form:
        created = await upload(store, tenant, form)
    return SafeJSONResponse(file_json(created))


@files_router.get("/v1/files", response_model=FileList,
                  responses={400: error("limit, order or after is not valid.")})
async def list_files(request: Request, store: Files,
                     purpose: str | None = None, limit: int = LIST_LIMIT_MAX,
                     after: str | None = None, order: str = "desc") -> SafeJSONResponse:
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequest(f"limit must be from 1 to {LIST_LIMIT_MAX}.", param="limit")
    if order not in get_args(FileOrder):
        raise InvalidRequest("order must be asc or desc.", param="order")
    if after is not None and not is_file_id(after):
        raise InvalidRequest("after must be a file id (file-...).", param="after")
    page = await store.list(identity_of(request).tenant, purpose=purpose,
                                      limit=limit, after=after,
                                      order=cast(FileOrder, order))
    return SafeJSONResponse(page_json(page))


@files_router.get("/v1/files/{file_id}", response_model=OpenAIFile, responses=_NOT_FOUND)
async def retrieve_file(file_id: str, request: Request, store: Files
                        ) -> SafeJSONResponse:
    found = await store.get(identity_of(request).tenant, file_id)
    return SafeJSONResponse(file_json(found))


@files_router.get("/v1/files/{file_id}/content", response_class=StreamingResponse,
                  responses={200: {"content": _BINARY, "description": "The file's bytes."},
                             **_NOT_FOUND})
async def file_content(file_id: str, request: Request, store: Files
                       ) -> StreamingResponse:
    found, chunks = await store.open(identity_of(request).tenant, file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"Content-Length": str(found.bytes)})


@files_router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=_NOT_FOUND)
async def delete_file(file_id: str, request: Request, store: Files
                      ) -> SafeJSONResponse:
    deleted = await store.delete(identity_of(request).tenant, file_id)
    return SafeJSONResponse(deleted_json(deleted))

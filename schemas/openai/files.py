"""The Files API's OpenAI shapes: the file object, the page of files, the
deletion answer; built from store records here, and documented for
``/openapi.json`` by the models below. The owning tenant is never shown."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from conveyor.files.store import FileObject, FilePage

__all__ = ["file_json", "page_json", "deleted_json", "OpenAIFile", "FileList", "FileDeleted"]


def file_json(record: FileObject) -> dict[str, Any]:
    # expires_at: Conveyor keeps files until they are deleted
    return {"id": record.id, "object": "file", "bytes": record.bytes,
            "created_at": record.created_at, "filename": record.filename,
            "purpose": record.purpose, "status": record.status, "expires_at": None,
            "status_details": None}


def page_json(page: FilePage) -> dict[str, Any]:
    data = [file_json(record) for record in page.data]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": page.has_more}


def deleted_json(record: FileObject) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "deleted": True}


class OpenAIFile(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    expires_at: int | None
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[OpenAIFile]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool

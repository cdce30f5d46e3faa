"""The file store's contract: what the Files API and the batch machinery need
from wherever files live (a local directory now, S3 or the like later).

A file belongs to one tenant. Every method takes the caller's tenant, and a
file of another tenant is answered exactly as one that does not exist
(:class:`FileNotFound`, a 404 ``File not found``), so a tenant can never learn
that another tenant's file exists. A deleted file is gone the same way.

What an implementation of :class:`FileStore` must guarantee:

- ``create(tenant, purpose, filename, content)`` stores ``content`` (bytes,
  or an async iterable of byte chunks consumed once, in order) under a new id
  from :func:`new_file_id` and answers its :class:`FileObject`. It is all or
  nothing: until it returns, no reader (``get``, ``open``, ``list``) sees the
  file, and if iterating ``content`` raises (an upload check refusing the
  file, a client that left) or the store fails, nothing of the file stays
  visible and the exception propagates unchanged. The store checks nothing
  about the content: the upload rules live in :mod:`gateway.files.uploads`,
  and trusted writers (the batch machinery writing ``batch_output`` files)
  pass bytes straight in.
- ``get(tenant, file_id)`` answers the record; ``open`` answers the record
  and the content as chunks (the content of a file deleted after ``open``
  returned may still be read to its end, or may fail: it is never mixed with
  another file's bytes); ``read`` answers the whole content as bytes.
- ``delete(tenant, file_id)`` answers the record it removed; afterwards the
  file is gone for every method.
- ``list(tenant, purpose=, limit=, after=, order=)`` answers a
  :class:`FilePage` of the tenant's files in creation order (``asc``) or its
  reverse (``desc``, the default). Ids are ordered as their creation time
  (:func:`new_file_id` puts the millisecond first), so the order is the order
  of ids and ``after`` is a cursor that stays valid when its file is deleted:
  the page holds the files strictly after it in the chosen order.
- An id that does not match ``file-`` + 24 hex digits is refused with
  :class:`FileNotFound` before anything is looked up, so no id reaches a path,
  key or query unchecked.
- Every method is a coroutine that never blocks the event loop on I/O.

The tenant travels with every record (:attr:`FileObject.tenant`) but is never
shown to a client: :mod:`schemas.openai.files` builds the OpenAI shapes.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, get_args

from conveyor.errors import RequestError
from conveyor.settings import JobsSettings

__all__ = ["FileStore", "FileObject", "FilePage", "FilePurpose", "FileOrder", "FileContent",
           "FileNotFound", "new_file_id", "is_file_id", "LIST_LIMIT_MAX", "CHUNK_BYTES"]

# The purposes Conveyor keeps files for: batch input (uploaded by clients) and
# batch output and error files (written by the batch machinery); OpenAI names
# both of the latter "batch_output".
FilePurpose = Literal["batch", "batch_output"]
FILE_PURPOSES: tuple[str, ...] = get_args(FilePurpose)
FileOrder = Literal["asc", "desc"]
FileContent = bytes | AsyncIterable[bytes]

# OpenAI's largest page of files (and its default page size).
LIST_LIMIT_MAX = 10_000
# How much of a file one read or one chunk of a stream holds at most.
CHUNK_BYTES = 1024 * 1024

_FILE_ID = re.compile(r"file-[0-9a-f]{24}")


def new_file_id(now_ms: int | None = None) -> str:
    """``file-`` + 24 hex digits: 12 of the creation time in milliseconds (so
    that ids sort as the files were made), 12 random (48 bits, unique among the
    files of one millisecond)."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    return f"file-{ms & 0xFFFF_FFFF_FFFF:012x}{secrets.token_hex(6)}"


def is_file_id(text: str) -> bool:
    return _FILE_ID.fullmatch(text) is not None


class FileNotFound(RequestError):
    """Unknown, deleted, another tenant's, or not an id at all: one answer for all."""

    status = 404
    type = "invalid_request_error"
    code = "file_not_found"

    def __init__(self, file_id: str) -> None:
        shown = file_id if is_file_id(file_id) else "that id"
        super().__init__(f"File not found: {shown}.", param="file_id")


@dataclass(frozen=True)
class FileObject:
    """One stored file, with the tenant that owns it."""

    id: str
    tenant: str
    purpose: FilePurpose
    filename: str
    bytes: int
    created_at: int  # Unix seconds
    status: Literal["processed"] = "processed"

    def to_record(self) -> dict[str, Any]:
        """The stored form of the record (tenant included), JSON-ready."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> FileObject:
        purpose = record["purpose"]
        if purpose not in FILE_PURPOSES:
            raise ValueError(f"unknown file purpose {purpose!r}")
        return cls(id=str(record["id"]), tenant=str(record["tenant"]), purpose=purpose,
                   filename=str(record["filename"]), bytes=int(record["bytes"]),
                   created_at=int(record["created_at"]))


@dataclass(frozen=True)
class FilePage:
    """One page of a tenant's files, and whether more follow it."""

    data: tuple[FileObject, ...]
    has_more: bool


class FileStore(Protocol):
    """Where a tenant's files live; see the module's docstring for the contract."""

    # the settings the store was built with: uploads are checked against its limits
    jobs: JobsSettings

    async def create(self, tenant: str, purpose: FilePurpose, filename: str,
                     content: FileContent, file_id: str | None = None) -> FileObject: ...

    async def get(self, tenant: str, file_id: str) -> FileObject: ...

    async def open(self, tenant: str, file_id: str
                   ) -> tuple[FileObject, AsyncIterator[bytes]]: ...

    async def read(self, tenant: str, file_id: str) -> bytes: ...

    async def delete(self, tenant: str, file_id: str) -> FileObject: ...

    async def list(self, tenant: str, *, purpose: str | None = None,
                   limit: int = LIST_LIMIT_MAX, after: str | None = None,
                   order: FileOrder = "desc") -> FilePage: ...

"""What the file store (:class:`~conveyor.files.local.LocalFileStore`) keeps
and answers: a file's record, a page of them, its id. A file belongs to one tenant;
another tenant's file, a deleted one or a malformed id are all
:class:`FileNotFound`. Creation is all or nothing, ids sort by creation time.
The contract in full: docs/api/jobs.md#the-file-stores-contract.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterable
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from conveyor.errors import RequestError

__all__ = ["FileObject", "FilePage", "FilePurpose", "FileOrder", "FileContent",
           "FileNotFound", "new_file_id", "is_file_id", "LIST_LIMIT_MAX", "CHUNK_BYTES"]

# The purposes Conveyor keeps files for: batch input (uploaded by clients),
# batch output and error files (written by the batch machinery; OpenAI names
# both "batch_output"), and the images of chat messages (conveyor/files/images.py).
FilePurpose = Literal["batch", "batch_output", "vision"]
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

"""What a client may upload to ``POST /v1/files``, checked while the file is
stored: ``purpose`` ``batch`` (else 400), not empty, at most
``jobs.max_file_bytes`` (413), UTF-8 JSON Lines of at most
``jobs.batch_max_lines`` objects, the first bad line named by its number (from
1). :class:`UploadCheck` sees the file chunk by chunk (:func:`checked`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import cast

from starlette.datastructures import FormData, UploadFile

from conveyor.errors import InvalidRequest, RequestTooLarge
from conveyor.files.local import LocalFileStore
from conveyor.files.store import CHUNK_BYTES, FileObject, FilePurpose
from conveyor.settings import JobsSettings

__all__ = ["UPLOAD_PURPOSES", "check_purpose", "UploadCheck", "checked", "upload"]

UPLOAD_PURPOSES: tuple[FilePurpose, ...] = ("batch",)
_BLANK = b" \t\r\f\v"


def check_purpose(purpose: object) -> FilePurpose:
    if not isinstance(purpose, str) or not purpose:
        raise InvalidRequest("The 'purpose' field is required; Conveyor accepts 'batch'.",
                             param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"Files with purpose '{purpose}' are not served by Conveyor; "
                             "upload batch input files with purpose 'batch'.",
                             param="purpose")
    return cast(FilePurpose, purpose)


class UploadCheck:
    """The checks of one upload (a batch's JSON Lines: the one purpose taken), fed its
    bytes in order; raises at the first fault."""

    def __init__(self, jobs: JobsSettings) -> None:
        self.max_bytes = jobs.max_file_bytes
        self.max_lines = jobs.batch_max_lines
        self.size = 0
        self.line_number = 0  # lines seen, empty ones included
        self.requests = 0  # non-empty lines seen
        self._tail = bytearray()  # the line not yet ended by a newline

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise RequestTooLarge(f"The file is larger than {self.max_bytes} bytes, the "
                                  "most Conveyor accepts.", param="file")
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if self._tail:  # a line that began in an earlier chunk
                self._tail += chunk[start:end]
                self._line(bytes(self._tail))
                self._tail.clear()
            else:
                self._line(chunk[start:end])
            start = end + 1
        self._tail += chunk[start:]  # a long line grows in place, never copied over again

    def finish(self) -> None:
        if self.size == 0:
            raise InvalidRequest("The file is empty.", param="file")
        if self._tail:
            self._line(bytes(self._tail))
            self._tail.clear()
        if self.requests == 0:
            raise InvalidRequest("The file holds no requests: a batch file has one JSON "
                                 "object per line.", param="file")

    def _line(self, raw: bytes) -> None:
        self.line_number += 1
        line = raw.strip(_BLANK)
        if not line:
            return
        self.requests += 1
        if self.requests > self.max_lines:
            raise InvalidRequest(f"The file holds more than {self.max_lines} requests "
                                 f"(line {self.line_number}); split it into several "
                                 "batches.", param="file")
        n = self.line_number
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"Line {n} of the file is not UTF-8 text.",
                                 param="file") from None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"Line {n} of the file is not valid JSON: {exc.msg} "
                                 f"(column {exc.colno}).", param="file") from None
        except RecursionError:
            raise InvalidRequest(f"Line {n} of the file is nested too deeply to read.",
                                 param="file") from None
        if not isinstance(value, dict):
            raise InvalidRequest(f"Line {n} of the file is not a JSON object.", param="file")


async def checked(chunks: AsyncIterable[bytes], check: UploadCheck) -> AsyncIterator[bytes]:
    """``chunks`` passed on after ``check`` has seen each one; the end of the
    stream is only passed on once the whole file has passed."""
    async for chunk in chunks:
        await asyncio.to_thread(check.feed, chunk)
        yield chunk
    await asyncio.to_thread(check.finish)


async def _read(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(CHUNK_BYTES):
        yield chunk


async def upload(store: LocalFileStore, tenant: str, form: FormData) -> FileObject:
    """Store the ``file`` of a multipart form for ``tenant``, checked."""
    purpose = check_purpose(form.get("purpose"))
    file = form.get("file")
    if not isinstance(file, UploadFile):
        raise InvalidRequest("The 'file' field is required: send the file as a part of a "
                             "multipart/form-data body, with a filename.", param="file")
    return await store.create(tenant, purpose, file.filename or "upload.jsonl",
                              checked(_read(file), UploadCheck(store.jobs)))

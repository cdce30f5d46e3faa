""":class:`LocalFileStore`: the file store, in a local directory
(``settings.jobs.files_dir``), one directory per tenant (named by a hash), each
file's content and record written to a temporary name, fsynced and renamed; a
file exists when its record does. Layout and decisions:
docs/api/jobs.md#the-local-directory.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import IO

from conveyor.files.store import (
    CHUNK_BYTES,
    LIST_LIMIT_MAX,
    FileContent,
    FileNotFound,
    FileObject,
    FileOrder,
    FilePage,
    FilePurpose,
    is_file_id,
    new_file_id,
)
from conveyor.settings import JobsSettings

__all__ = ["LocalFileStore"]

_RECORD = re.compile(r"(file-[0-9a-f]{24})\.json")


class LocalFileStore:
    """Where a tenant's files live, under ``jobs.files_dir``; the contract:
    docs/api/jobs.md#the-file-stores-contract."""

    def __init__(self, jobs: JobsSettings) -> None:
        self.jobs = jobs
        self.root = Path(jobs.files_dir)

    def tenant_dir(self, tenant: str) -> Path:
        digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()
        return self.root / digest[:32]

    def _paths(self, tenant: str, file_id: str) -> tuple[Path, Path]:
        """The content and record paths of a valid id (FileNotFound for any other)."""
        if not is_file_id(file_id):
            raise FileNotFound(file_id)
        directory = self.tenant_dir(tenant)
        return directory / file_id, directory / f"{file_id}.json"

    async def create(self, tenant: str, purpose: FilePurpose, filename: str,
                     content: FileContent, file_id: str | None = None) -> FileObject:
        now_ms = int(time.time() * 1000)
        if file_id is not None and not is_file_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        # created_at is the id's time: the two order alike (a given id, written again
        # by a job that finishes twice, replaces its file whole)
        file_id = file_id or new_file_id(now_ms)
        directory = self.tenant_dir(tenant)
        staged = await asyncio.to_thread(_Staged, directory, file_id)
        try:
            async for chunk in _chunks(content):
                await asyncio.to_thread(staged.write, chunk)
            created = FileObject(id=file_id, tenant=tenant, purpose=purpose,
                                 filename=filename, bytes=staged.size,
                                 created_at=now_ms // 1000)
            staged.committing = True
            await asyncio.to_thread(staged.commit, created)
        except BaseException:
            staged.discard()  # an unlink: quick, and safe in a task being cancelled
            raise
        return created

    async def get(self, tenant: str, file_id: str) -> FileObject:
        _, record = self._paths(tenant, file_id)
        return await asyncio.to_thread(self._load, tenant, file_id, record)

    async def open(self, tenant: str, file_id: str
                   ) -> tuple[FileObject, AsyncIterator[bytes]]:
        content, record = self._paths(tenant, file_id)

        def opened() -> tuple[FileObject, IO[bytes]]:
            found = self._load(tenant, file_id, record)
            try:
                return found, open(content, "rb")  # noqa: SIM115 (closed by _stream)
            except FileNotFoundError:  # deleted between the two
                raise FileNotFound(file_id) from None

        found, handle = await asyncio.to_thread(opened)
        return found, _stream(handle)

    async def read(self, tenant: str, file_id: str) -> bytes:
        _, chunks = await self.open(tenant, file_id)
        return b"".join([chunk async for chunk in chunks])

    async def delete(self, tenant: str, file_id: str) -> FileObject:
        content, record = self._paths(tenant, file_id)

        def remove() -> FileObject:
            found = self._load(tenant, file_id, record)
            try:
                record.unlink()
            except FileNotFoundError:  # another request deleted it first
                raise FileNotFound(file_id) from None
            content.unlink(missing_ok=True)
            _sync_dir(record.parent)
            return found

        return await asyncio.to_thread(remove)

    async def touch(self, tenant: str, file_id: str) -> None:
        """Mark the file used now (its content's modification time)."""
        content, _ = self._paths(tenant, file_id)

        def touched() -> None:
            try:
                os.utime(content)
            except FileNotFoundError:
                raise FileNotFound(file_id) from None

        await asyncio.to_thread(touched)

    async def unused_since(self, purpose: FilePurpose, before_s: float
                           ) -> builtins.list[FileObject]:
        """Every tenant's files of ``purpose`` not used (written or touched)
        since ``before_s`` (epoch seconds)."""

        def walk() -> builtins.list[FileObject]:
            found: builtins.list[FileObject] = []
            for directory in sorted(self.root.glob("*")) if self.root.is_dir() else []:
                for record in sorted(directory.glob("*.json")):
                    try:
                        obj = FileObject.from_record(json.loads(record.read_text("utf-8")))
                        used = os.stat(directory / obj.id).st_mtime
                    except (OSError, ValueError, KeyError):
                        continue  # being written or deleted beside this walk
                    if obj.purpose == purpose and used < before_s:
                        found.append(obj)
            return found

        return await asyncio.to_thread(walk)

    async def list(self, tenant: str, *, purpose: str | None = None,
                   limit: int = LIST_LIMIT_MAX, after: str | None = None,
                   order: FileOrder = "desc") -> FilePage:
        if after is not None and not is_file_id(after):
            raise ValueError(f"after is not a file id: {after!r}")
        return await asyncio.to_thread(self._page, tenant, purpose, limit, after, order)

    def _page(self, tenant: str, purpose: str | None, limit: int, after: str | None,
              order: FileOrder) -> FilePage:
        directory = self.tenant_dir(tenant)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return FilePage(data=(), has_more=False)
        ids = sorted((m.group(1) for m in map(_RECORD.fullmatch, names) if m),
                     reverse=order == "desc")
        if after is not None:
            ids = [i for i in ids if (i > after if order == "asc" else i < after)]
        found: builtins.list[FileObject] = []
        for file_id in ids:
            try:
                record = self._load(tenant, file_id, directory / f"{file_id}.json")
            except FileNotFound:  # deleted while this page was read
                continue
            if purpose is None or record.purpose == purpose:
                found.append(record)
                if len(found) > limit:
                    break
        return FilePage(data=tuple(found[:limit]), has_more=len(found) > limit)

    @staticmethod
    def _load(tenant: str, file_id: str, record: Path) -> FileObject:
        try:
            text = record.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFound(file_id) from None
        found = FileObject.from_record(json.loads(text))
        if found.tenant != tenant or found.id != file_id:
            raise FileNotFound(file_id)
        return found


class _Staged:
    """A file being written under a temporary name in its tenant's directory."""

    def __init__(self, directory: Path, file_id: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.file_id = file_id
        self.temp = directory / f".{file_id}.{secrets.token_hex(4)}.tmp"
        self.handle: IO[bytes] | None = open(self.temp, "xb")  # noqa: SIM115
        self.size = 0
        self.committing = False

    def write(self, chunk: bytes) -> None:
        assert self.handle is not None
        self.handle.write(chunk)
        self.size += len(chunk)

    def commit(self, record: FileObject) -> None:
        """Content into place, then the record (which makes the file exist)."""
        assert self.handle is not None
        handle, self.handle = self.handle, None
        content = self.directory / self.file_id
        try:
            with handle:
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(self.temp, content)
            _write_atomically(self.directory / f"{self.file_id}.json",
                              json.dumps(record.to_record()).encode())
        except BaseException:
            self.temp.unlink(missing_ok=True)
            content.unlink(missing_ok=True)
            raise
        _sync_dir(self.directory)

    def discard(self) -> None:
        """Forget a file whose content did not come whole. Once the commit has begun
        it runs to its end in its thread whatever happens to the request (a
        cancelled upload then leaves a complete file, or nothing visible)."""
        if self.committing:
            return
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        self.temp.unlink(missing_ok=True)


def _write_atomically(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _sync_dir(directory: Path) -> None:
    """Make the renames and unlinks in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _chunks(content: FileContent) -> AsyncIterator[bytes]:
    if isinstance(content, bytes | bytearray | memoryview):
        view = memoryview(content)
        for start in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[start:start + CHUNK_BYTES])
        return
    assert isinstance(content, AsyncIterable)
    async for chunk in content:
        yield chunk


async def _stream(handle: IO[bytes]) -> AsyncIterator[bytes]:
    """The content in chunks, read in a thread; the file is closed when the stream
    ends, fails or is closed early."""
    try:
        while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()

"""What the jobs layers need of the file store (gateway/files): read a
batch's input, write its output and error files."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["JobFiles"]


class JobFiles(Protocol):
    async def read(self, tenant: str, file_id: str) -> bytes: ...

    async def create(self, tenant: str, purpose: Any, filename: str, content: bytes,
                     file_id: str | None = None) -> Any: ...

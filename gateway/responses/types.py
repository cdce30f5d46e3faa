"""The contract between ``POST /v1/responses`` and the background responses.

A request with ``background: true`` is handed, validated and turned into its
generation, to the background responses the gateway's services hold: whatever
implements :class:`BackgroundResponses` there answers it (admission, storage, running
the generation later). Its result is sent as the 200 body (OpenAI answers a
background request at once with the response ``queued``, built with
:func:`gateway.responses.objects.response_object`). Without it, a background
request is refused with 400 naming ``background``.
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.auth.types import Identity
from schemas.openai.responses import ResponsesRequest
from schemas.records import Generation

__all__ = ["BackgroundResponses"]


class BackgroundResponses(Protocol):
    async def create(self, identity: Identity, body: ResponsesRequest,
                     generation: Generation) -> dict[str, Any]:
        """Take a background response; its Response object as it stands now."""
        ...

    async def retrieve(self, identity: Identity, response_id: str) -> dict[str, Any]:
        """The caller's background response as it stands now; 404 when none."""
        ...

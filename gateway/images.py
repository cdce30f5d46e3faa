"""The image parts of a chat request taken in: refused for a model the caller
may not use (404, as admission says it) or one that does not declare vision
(400 naming the first part), counted, each read (a base64 data
URL; an http(s) URL only of a host ``images.allowed_hosts`` lists, fetched
with a timeout and a size cap, no redirects), checked (conveyor/images.py),
and kept once in the file store; the event carries each as an
:class:`~schemas.records.ImageRef`. The rules: docs/api/chat.md#images.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from urllib.parse import urlsplit

import aiohttp

from conveyor.errors import InvalidRequest, ModelNotFound
from conveyor.files.images import ImageStore
from conveyor.images import check_image
from conveyor.registry import Registry
from conveyor.settings import ImagesSettings
from gateway.auth.types import Identity
from schemas.openai.requests import ChatCompletionRequest, ImagePart
from schemas.records import ImageRef

__all__ = ["ImageIntake", "PartKey"]

# (message index, content index) of an image part
PartKey = tuple[int, int]

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


class ImageIntake:
    """Reads, checks and stores the images of chat requests."""

    def __init__(self, settings: ImagesSettings, store: ImageStore, registry: Registry) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry

    async def refs(self, body: ChatCompletionRequest, identity: Identity
                   ) -> dict[PartKey, ImageRef]:
        """Every image part of ``body``, stored for ``identity``'s tenant: its
        reference by where it stands. Nothing is stored for a model the caller
        may not use (404, as admission answers) or one without vision (400)."""
        parts = [(i, j, chars, part) for i, message in enumerate(body.messages)
                 for j, chars, part in message.image_parts()]
        if not parts:
            return {}
        first = _param(parts[0][0], parts[0][1])
        spec = self.registry.find(body.model)
        if spec is None or not (identity.may_use(body.model) or identity.may_use(spec.name)):
            raise ModelNotFound(f"The model `{body.model}` does not exist or you do not have "
                                "access to it.", param="model")
        if not spec.vision:
            raise InvalidRequest(f"The model `{body.model}` does not read images; "
                                 f"'{first}' is an image part. Send images to a model "
                                 "that declares vision.", param=first)
        if len(parts) > self.settings.max_count:
            extra = _param(*parts[self.settings.max_count][:2])
            raise InvalidRequest(f"Invalid '{extra}': a request holds at most "
                                 f"{self.settings.max_count} images.", param=extra)
        out: dict[PartKey, ImageRef] = {}
        for i, j, chars, part in parts:
            param = _param(i, j)
            data, declared = await self._read(part, param)
            checked = await asyncio.to_thread(check_image, data, declared,
                                              self.settings.max_pixels, param)
            file_id, digest = await self.store.put(identity.tenant, data, checked.media_type)
            out[(i, j)] = ImageRef(file_id=file_id, media_type=checked.media_type,
                                   bytes=len(data), sha256=digest, width=checked.width,
                                   height=checked.height, detail=part.image_url.detail,
                                   offset=chars, part=param)
        return out

    async def _read(self, part: ImagePart, param: str) -> tuple[bytes, str | None]:
        """The image's bytes, and the media type a data URL declares."""
        url = part.image_url.url
        if url[:5].lower() == "data:":
            return self._decoded(url, param)
        scheme = urlsplit(url).scheme.lower()
        if scheme not in ("http", "https"):
            raise InvalidRequest(f"Invalid '{param}.image_url.url': expected a data URL "
                                 "(data:image/png;base64,...) or an http(s) URL.",
                                 param=f"{param}.image_url.url")
        return await self._fetched(url, param), None

    def _decoded(self, url: str, param: str) -> tuple[bytes, str | None]:
        where = f"{param}.image_url.url"
        match = _DATA_URL.match(url)
        if match is None or ";base64" not in match.group(2).lower():
            raise InvalidRequest(f"Invalid '{where}': expected a base64 data URL "
                                 "(data:image/png;base64,...).", param=where)
        payload = url[match.end():]
        limit = self.settings.max_bytes
        if len(payload) > (limit + 2) // 3 * 4 + 4:  # told before anything is decoded
            raise _too_large(param, limit)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"Invalid '{where}': the data is not valid base64.",
                                 param=where) from None
        if len(data) > limit:
            raise _too_large(param, limit)
        return data, match.group(1).strip().lower() or None

    async def _fetched(self, url: str, param: str) -> bytes:
        where = f"{param}.image_url.url"
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.settings.hosts():
            raise InvalidRequest(f"Invalid '{where}': Conveyor does not fetch images from "
                                 f"{host or 'that URL'}; send the image as a data URL "
                                 "(data:image/png;base64,...).", param=where)
        limit = self.settings.max_bytes
        timeout = aiohttp.ClientTimeout(total=self.settings.fetch_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, \
                    session.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise InvalidRequest(f"Invalid '{where}': fetching the image got HTTP "
                                         f"{response.status}.", param=where)
                data = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(param, limit)
                return bytes(data)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise InvalidRequest(f"Invalid '{where}': the image could not be fetched "
                                 f"({type(exc).__name__}).", param=where) from None


def _param(message: int, part: int) -> str:
    return f"messages[{message}].content[{part}]"


def _too_large(param: str, limit: int) -> InvalidRequest:
    return InvalidRequest(f"Invalid '{param}': the image is larger than {limit} bytes, the "
                          "most Conveyor accepts.", param=param, code="image_too_large")


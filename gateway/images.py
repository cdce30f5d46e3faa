"""The image parts of a chat or Responses request taken in: refused for a
model the caller may not use (404, as admission says it) or one that does not
declare vision (400 naming the first part), counted, each read (a base64 data
URL; an http(s) URL only of a host and port ``images.allowed_hosts`` lists, at
a public address, fetched with a timeout and a size cap, unencoded, no
redirects), checked (conveyor/images.py),
and kept once in the file store; the event carries each as an
:class:`~schemas.records.ImageRef`. The rules: docs/api/chat.md#images.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from conveyor.errors import InvalidRequest, ModelNotFound
from conveyor.files.images import ImageStore
from conveyor.images import check_image
from conveyor.registry import Registry
from conveyor.settings import ImagesSettings
from gateway.auth.types import Identity
from schemas.openai.requests import ChatCompletionRequest
from schemas.openai.responses import InputMessage, ResponsesRequest
from schemas.records import ImageRef

__all__ = ["ImageIntake", "PartKey"]

# (message or input item index, content index) of an image part
PartKey = tuple[int, int]

_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


class ImageIntake:
    """Reads, checks and stores the images of chat and Responses requests."""

    def __init__(self, settings: ImagesSettings, store: ImageStore, registry: Registry) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry

    async def refs(self, body: ChatCompletionRequest, identity: Identity
                   ) -> dict[PartKey, ImageRef]:
        """Every image part of a chat request, stored for ``identity``'s tenant:
        its reference by where it stands (:meth:`stored`)."""
        return await self.stored(body.model, identity, [
            _Part((i, j), f"messages[{i}].content[{j}]", chars, part.image_url.url,
                  part.image_url.detail)
            for i, message in enumerate(body.messages)
            for j, chars, part in message.image_parts()])

    async def input_refs(self, body: ResponsesRequest, identity: Identity
                         ) -> dict[PartKey, ImageRef]:
        """Every image part of a Responses request's input (by item and part),
        stored as :meth:`refs` stores a chat's; one that names a ``file_id``
        is refused."""
        parts = []
        for i, item in enumerate(body.input if isinstance(body.input, list) else ()):
            for j, chars, part in item.image_parts() if isinstance(item, InputMessage) else ():
                where = f"input[{i}].content[{j}]"
                if part.file_id is not None or not part.image_url:
                    raise InvalidRequest(f"Invalid '{where}': Conveyor takes an image as its "
                                         "image_url (a data URL)" + (
                                             ", not a file_id" if part.file_id else "") + ".",
                                         param=where)
                parts.append(_Part((i, j), where, chars, part.image_url, part.detail))
        return await self.stored(body.model, identity, parts)

    async def stored(self, model: str, identity: Identity, parts: list[_Part]
                     ) -> dict[PartKey, ImageRef]:
        """``parts`` read, checked and stored. Nothing is stored for a model the
        caller may not use (404, as admission answers) or one without vision (400
        naming the first part), past the count, nor when any image is refused."""
        if not parts:
            return {}
        first = parts[0].param
        spec = self.registry.find(model)
        if spec is None or not (identity.may_use(model) or identity.may_use(spec.name)):
            raise ModelNotFound(f"The model `{model}` does not exist or you do not have "
                                "access to it.", param="model")
        if not spec.vision:
            raise InvalidRequest(f"The model `{model}` does not read images; "
                                 f"'{first}' is an image part. Send images to a model "
                                 "that declares vision.", param=first)
        if len(parts) > self.settings.max_count:
            extra = parts[self.settings.max_count].param
            raise InvalidRequest(f"Invalid '{extra}': a request holds at most "
                                 f"{self.settings.max_count} images.", param=extra)
        read = []
        for part in parts:  # every image read and checked before any is stored
            data, declared = await self._read(part.url, part.param)
            read.append((data, await asyncio.to_thread(check_image, data, declared,
                                                       self.settings.max_pixels, part.param)))
        out: dict[PartKey, ImageRef] = {}
        for part, (data, checked) in zip(parts, read, strict=True):
            file_id, digest = await self.store.put(identity.tenant, data, checked.media_type)
            out[part.key] = ImageRef(file_id=file_id, media_type=checked.media_type,
                                     bytes=len(data), sha256=digest, width=checked.width,
                                     height=checked.height, detail=part.detail,
                                     offset=part.chars, part=part.param)
        return out

    async def _read(self, url: str, param: str) -> tuple[bytes, str | None]:
        """The image's bytes, and the media type a data URL declares."""
        if url[:5].lower() == "data:":
            return self._decoded(url, param)
        where = _url_param(param)
        try:  # parsed once: the URL checked is the URL fetched
            parsed = URL(url)
        except ValueError:  # a bracketed host that is no IPv6 address
            raise InvalidRequest(f"Invalid '{where}': not a URL.", param=where) from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise InvalidRequest(f"Invalid '{where}': expected a data URL "
                                 "(data:image/png;base64,...) or an http(s) URL.", param=where)
        return await self._fetched(parsed, param), None
    def _decoded(self, url: str, param: str) -> tuple[bytes, str | None]:
        where = _url_param(param)
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

    async def _fetched(self, url: URL, param: str) -> bytes:
        where = _url_param(param)
        host = url.host or ""
        if not _allowed(url, self.settings.hosts()):
            shown = host if url.is_default_port() else f"{host}:{url.port}"
            raise InvalidRequest(f"Invalid '{where}': Conveyor does not fetch images from "
                                 f"{shown}; send the image as a data URL "
                                 "(data:image/png;base64,...).", param=where)
        private = self.settings.allow_private_addresses
        if not private and _literal(host) is not None and not _public(host):
            raise _not_public(where, host)
        limit = self.settings.max_bytes
        timeout = aiohttp.ClientTimeout(total=self.settings.fetch_timeout_s)
        connector = aiohttp.TCPConnector(resolver=_PublicResolver(private))
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                             auto_decompress=False) as session, \
                    session.get(url, allow_redirects=False,
                                headers={"Accept-Encoding": "identity"}) as response:
                if response.status != 200:
                    raise InvalidRequest(f"Invalid '{where}': fetching the image got HTTP "
                                         f"{response.status}.", param=where)
                encoding = response.headers.get("Content-Encoding", "").strip().lower()
                if encoding not in ("", "identity"):  # the size cap counts the bytes as sent
                    raise InvalidRequest(f"Invalid '{where}': the image came encoded "
                                         f"({encoding}); Conveyor fetches images unencoded.",
                                         param=where)
                data = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(param, limit)
                return bytes(data)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, _NotPublic):
                raise _not_public(where, host) from None
            raise _unfetched(where, exc) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: yarl's
            raise _unfetched(where, exc) from None


class _NotPublic(OSError):
    """A host that resolves to no public address."""


class _PublicResolver(AbstractResolver):
    """aiohttp's resolver, keeping only the public addresses a host resolves to
    (all with ``private``): the address checked is the one connected to, so a
    listed name that resolves into the gateway's own network is not reached."""

    def __init__(self, private: bool) -> None:
        self.private = private
        self.resolver = DefaultResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        found = await self.resolver.resolve(host, port, family)
        kept = [r for r in found if self.private or _public(r["host"])]
        if not kept:
            raise _NotPublic(f"{host} resolves to no public address")
        return kept

    async def close(self) -> None:
        await self.resolver.close()


def _allowed(url: URL, hosts: frozenset[str]) -> bool:
    """Whether ``hosts`` (``images.allowed_hosts``) lists the URL's host at its
    port: a host alone stands for its scheme's default port only."""
    host = url.host or ""
    name = f"[{host}]" if ":" in host else host
    if f"{name}:{url.port}" in hosts:
        return True
    return url.is_default_port() and (name in hosts or host in hosts)


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _public(address: str) -> bool:
    """Whether ``address`` is a global one: not loopback, private, link-local
    (169.254.169.254), shared, reserved or multicast (an IPv4 address inside
    IPv6 judged as itself)."""
    ip = _literal(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is not None and ip.is_global and not ip.is_multicast


def _not_public(where: str, host: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid '{where}': {host} is not at a public address; Conveyor "
                          "does not fetch images from its own network.", param=where)


def _unfetched(where: str, exc: Exception) -> InvalidRequest:
    return InvalidRequest(f"Invalid '{where}': the image could not be fetched "
                          f"({type(exc).__name__}).", param=where)


@dataclass(frozen=True)
class _Part:
    key: PartKey
    param: str  # messages[1].content[0], input[1].content[0]
    chars: int  # the characters of text before it in its message
    url: str
    detail: str


def _url_param(param: str) -> str:
    """The param of a part's URL: chat's ``image_url.url``, the Responses API's
    ``image_url``."""
    return f"{param}.image_url" + (".url" if param.startswith("messages") else "")


def _too_large(param: str, limit: int) -> InvalidRequest:
    return InvalidRequest(f"Invalid '{param}': the image is larger than {limit} bytes, the "
                          "most Conveyor accepts.", param=param, code="image_too_large")


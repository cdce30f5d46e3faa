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
import contextlib
import hashlib
import ipaddress
import re
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from conveyor.errors import InvalidRequest
from conveyor.files.images import ImageStore
from conveyor.images import check_image, not_seeing
from conveyor.registry import Registry
from conveyor.settings import ImagesSettings
from gateway.admission import Admitter, model_not_found
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

    def __init__(self, settings: ImagesSettings, store: ImageStore, registry: Registry,
                 admitter: Admitter) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.admitter = admitter  # whose model access and limits come before any image work

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
        """``parts`` read, checked and stored. Nothing is read or stored for a
        model the caller may not use (404, as admission answers) or one without
        vision (400 naming the first part), past the count, for a caller whose
        limits have no room left (429, as admission would answer), nor when any
        image is refused."""
        if not parts:
            return {}
        first = parts[0].param
        self.admitter.check_model(identity, model)
        spec = self.registry.find(model)
        if spec is None:
            raise model_not_found(model)
        if not spec.vision:
            raise not_seeing(model, first)
        if len(parts) > self.settings.max_count:
            extra = parts[self.settings.max_count].param
            raise InvalidRequest(f"Invalid '{extra}': a request holds at most "
                                 f"{self.settings.max_count} images.", param=extra)
        await self.admitter.may_start(identity, model)
        read = await self._read_all(parts)  # every image read and checked before any is stored
        out: dict[PartKey, ImageRef] = {}
        for part, image in zip(parts, read, strict=True):
            file_id = await self.store.put(identity.tenant, image.data, image.media_type,
                                           image.sha256)
            out[part.key] = ImageRef(file_id=file_id, media_type=image.media_type,
                                     bytes=len(image.data), sha256=image.sha256,
                                     width=image.width, height=image.height,
                                     detail=part.detail, offset=part.chars, part=part.param)
        return out

    async def _read_all(self, parts: list[_Part]) -> list[_Read]:
        """Every part read and checked at once: the remote ones fetched through
        one session, all within ``fetch_timeout_s``; the CPU's work (base64,
        Pillow, sha256) in a thread each. The first part's fault in their order
        is raised; a fault stops the others."""
        remote = [not _is_data_url(part.url) for part in parts]
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(self._session()) if any(remote) else None
            deadline = asyncio.get_running_loop().time() + self.settings.fetch_timeout_s
            tasks = [asyncio.create_task(self._read(part, session, deadline)) for part in parts]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            fault = None if task.cancelled() else task.exception()
            if fault is not None:
                raise fault
        return [task.result() for task in tasks]

    def _session(self) -> aiohttp.ClientSession:
        """A session that connects only to public addresses (unless
        ``allow_private_addresses``), and leaves bodies as they are sent."""
        connector = aiohttp.TCPConnector(
            resolver=_PublicResolver(self.settings.allow_private_addresses))
        return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(
                                         total=self.settings.fetch_timeout_s))

    async def _read(self, part: _Part, session: aiohttp.ClientSession | None,
                    deadline: float) -> _Read:
        """A part's image, read (a data URL's base64 decoded, a remote one
        fetched by ``deadline``) and checked in a thread."""
        limit, pixels = self.settings.max_bytes, self.settings.max_pixels
        if _is_data_url(part.url):
            start, declared = self._data_url(part.url, part.param)
            return await asyncio.to_thread(_decoded, part.url, start, declared, limit, pixels,
                                           part.param)
        url = self._remote(part.url, part.param)
        assert session is not None
        async with asyncio.timeout_at(deadline):
            data = await self._fetched(session, url, part.param)
        return await asyncio.to_thread(_checked, data, None, pixels, part.param)

    def _data_url(self, url: str, param: str) -> tuple[int, str | None]:
        """Where a data URL's base64 starts, and the media type it declares;
        its size checked on the base64 text, before anything is decoded."""
        where = _url_param(param)
        match = _DATA_URL.match(url)
        if match is None or ";base64" not in match.group(2).lower():
            raise InvalidRequest(f"Invalid '{where}': expected a base64 data URL "
                                 "(data:image/png;base64,...).", param=where)
        limit = self.settings.max_bytes
        if len(url) - match.end() > (limit + 2) // 3 * 4 + 4:
            raise _too_large(param, limit)
        return match.end(), match.group(1).strip().lower() or None

    def _remote(self, url: str, param: str) -> URL:
        """An http(s) URL of a listed host at its port, parsed once: the URL
        checked is the URL fetched."""
        where = _url_param(param)
        try:
            parsed = URL(url)
        except ValueError:  # a bracketed host that is no IPv6 address
            raise InvalidRequest(f"Invalid '{where}': not a URL.", param=where) from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise InvalidRequest(f"Invalid '{where}': expected a data URL "
                                 "(data:image/png;base64,...) or an http(s) URL.", param=where)
        host = parsed.host
        if not _allowed(parsed, self.settings.hosts()):
            shown = host if parsed.is_default_port() else f"{host}:{parsed.port}"
            raise InvalidRequest(f"Invalid '{where}': Conveyor does not fetch images from "
                                 f"{shown}; send the image as a data URL "
                                 "(data:image/png;base64,...).", param=where)
        if (not self.settings.allow_private_addresses and _literal(host) is not None
                and not _public(host)):
            raise _not_public(where, host)
        return parsed

    async def _fetched(self, session: aiohttp.ClientSession, url: URL, param: str) -> bytes:
        where = _url_param(param)
        limit = self.settings.max_bytes
        try:
            async with session.get(url, allow_redirects=False,
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
                raise _not_public(where, url.host or "") from None
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
class _Read:
    """An image read and checked: its bytes, their digest, what Pillow saw."""

    data: bytes
    sha256: str
    media_type: str
    width: int
    height: int


def _checked(data: bytes, declared: str | None, max_pixels: int, param: str) -> _Read:
    """``data`` checked (conveyor/images.py) and digested: CPU work, for a thread."""
    checked = check_image(data, declared, max_pixels, param)
    return _Read(data, hashlib.sha256(data).hexdigest(), checked.media_type, checked.width,
                 checked.height)


def _decoded(url: str, start: int, declared: str | None, limit: int, max_pixels: int,
             param: str) -> _Read:
    """The base64 of a data URL from ``start`` decoded, then :func:`_checked`."""
    where = _url_param(param)
    try:
        data = base64.b64decode(url[start:], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"Invalid '{where}': the data is not valid base64.",
                             param=where) from None
    if len(data) > limit:
        raise _too_large(param, limit)
    return _checked(data, declared, max_pixels, param)


def _is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


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


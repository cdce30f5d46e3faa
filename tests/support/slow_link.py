"""A TCP link between a client and a real service that holds each of the
service's replies for a while: a Redis that answers, slowly. The service
behind it is the real one; only the time its answers take is the test's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from conveyor.settings import Settings

__all__ = ["SlowLink", "slow_link", "slow_redis"]


@dataclass
class SlowLink:
    port: int  # where clients connect, on 127.0.0.1
    delay_s: float = 0.0  # how long each piece of a reply is held; changed at will
    _pumps: set[asyncio.Task[None]] = field(default_factory=set)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                link: SlowLink | None) -> None:
    try:
        while data := await reader.read(65536):
            if link is not None and link.delay_s > 0:
                await asyncio.sleep(link.delay_s)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def slow_link(host: str, port: int) -> AsyncIterator[SlowLink]:
    """A link to ``host:port`` on a free loopback port, open for the block."""
    link: SlowLink | None = None

    async def joined(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        assert link is not None
        server_r, server_w = await asyncio.open_connection(host, port)
        for pump in (_pump(client_r, server_w, None), _pump(server_r, client_w, link)):
            task = asyncio.create_task(pump)
            link._pumps.add(task)
            task.add_done_callback(link._pumps.discard)

    server = await asyncio.start_server(joined, "127.0.0.1", 0)
    link = SlowLink(server.sockets[0].getsockname()[1])
    try:
        yield link
    finally:
        server.close()
        for task in list(link._pumps):
            task.cancel()
        await asyncio.gather(*link._pumps, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def slow_redis(settings: Settings) -> AsyncIterator[tuple[SlowLink, Settings]]:
    """A link to ``settings``' Redis, and the settings that reach it through the link."""
    shared = urlsplit(settings.redis.url)
    async with slow_link(shared.hostname or "127.0.0.1", shared.port or 6379) as link:
        yield link, settings.replace(
            redis_url=f"redis://127.0.0.1:{link.port}/{shared.path[1:] or 0}")

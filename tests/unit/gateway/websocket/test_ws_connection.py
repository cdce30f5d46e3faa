"""One WebSocket under a real server (uvicorn, as ``conveyor gateway`` runs it)
and a real client (``websockets``): frames the protocol cannot take, the
server's one close, and handshakes the auth middleware refuses."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI, WebSocket
from pydantic import SecretStr
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from conveyor.settings import load_settings
from gateway.auth.authenticate import Authenticator
from gateway.auth.keys import KeyStore
from gateway.auth.middleware import AuthMiddleware
from gateway.websocket.protocol import Connection, ConnectionState, FrameError
from tests.support.asgi import serving

MAX_FRAME = 1024


def ws_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(AuthMiddleware,
                       authenticator=lambda scope: getattr(scope["app"].state, "authenticator",
                                                           None))
    app.state.after_close = []
    app.state.closed = threading.Event()

    @app.websocket("/v1/echo")
    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        connection = Connection(websocket, MAX_FRAME)
        while True:
            try:
                text = await connection.receive()
            except FrameError as exc:
                await connection.close(exc.code, exc.reason)
                return
            if text is None:
                return
            if text == "close":
                await connection.close(1000, "bye")
                await connection.close(1011, "a second close is not sent")
                app.state.after_close.append(
                    (connection.state, await connection.send("late"),
                     await connection.receive()))
                app.state.closed.set()
                return
            await connection.send(text)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FastAPI, str]]:
    app = ws_app()
    with serving(app) as port:
        yield app, f"ws://127.0.0.1:{port}"


@pytest.fixture
def open_app(server: tuple[FastAPI, str]) -> str:
    app, url = server
    app.state.authenticator = Authenticator(load_settings())
    return url


async def closed_with(url: str, send: str | bytes | None = None,
                      **kwargs: Any) -> tuple[int, str]:
    async with connect(url, open_timeout=10, **kwargs) as ws:
        if send is not None:
            await ws.send(send)
        with pytest.raises(ConnectionClosed) as caught:
            await ws.recv()
    assert caught.value.rcvd is not None
    return caught.value.rcvd.code, caught.value.rcvd.reason


async def test_text_frames_go_both_ways(open_app: str) -> None:
    async with connect(f"{open_app}/v1/echo") as ws:
        for text in ("one", "twø"):
            await ws.send(text)
            assert await ws.recv() == text


async def test_a_binary_frame_closes_with_1003(open_app: str) -> None:
    code, reason = await closed_with(f"{open_app}/v1/echo", b"\x00\x01")
    assert code == 1003 and "binary" in reason


async def test_a_frame_over_the_limit_closes_with_1009(open_app: str) -> None:
    code, reason = await closed_with(f"{open_app}/v1/echo", "x" * (MAX_FRAME + 1))
    assert code == 1009 and str(MAX_FRAME) in reason


async def test_the_server_closes_once_and_sends_nothing_after(
        server: tuple[FastAPI, str], open_app: str) -> None:
    app, _ = server
    assert await closed_with(f"{open_app}/v1/echo", "close") == (1000, "bye")
    assert await asyncio.to_thread(app.state.closed.wait, 5)
    assert app.state.after_close[-1] == (ConnectionState.CLOSED, False, None)


async def test_a_starting_gateway_closes_handshakes_with_1013(
        server: tuple[FastAPI, str]) -> None:
    app, url = server
    app.state.authenticator = None
    code, reason = await closed_with(f"{url}/v1/echo")
    assert code == 1013 and "starting" in reason


async def test_a_bad_or_missing_key_closes_with_1008_before_any_message(
        server: tuple[FastAPI, str]) -> None:
    app, url = server
    settings = load_settings(auth="keys", auth_secret=SecretStr("s" * 32),
                        topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    redis = aioredis.from_url(settings.redis.url)
    app.state.authenticator = Authenticator(settings, keys=KeyStore(settings, redis))
    try:
        code, reason = await closed_with(f"{url}/v1/echo")
        assert code == 1008 and "Authorization: Bearer" in reason
        code, reason = await closed_with(f"{url}/v1/echo",
                                         additional_headers={"Authorization": "Bearer nope"})
        assert code == 1008 and reason
    finally:
        app.state.authenticator = None
        await redis.aclose()

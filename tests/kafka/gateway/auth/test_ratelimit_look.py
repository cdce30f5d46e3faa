"""The look before a request's images (gateway/admission.py ``may_start``), on the
shared Redis: the admission's own script told not to count, so a key with no
room left costs the gateway no image fetched, decoded or stored. With Redis
stopped: tests/faults/gateway/auth/test_ratelimit.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from aiohttp import web

from conveyor.errors import RateLimited
from conveyor.files.local import LocalFileStore
from conveyor.registry import Registry
from gateway.admission import Admitter
from gateway.auth.ratelimit_windows import Check, LocalWindows, Scope
from gateway.auth.types import Identity, Limits
from schemas.openai.requests import ChatCompletionRequest
from tests.faults.gateway.auth.test_ratelimit import NOBODY, now_ms, replicas, settings
from tests.support.gateway_fakes import image_intake
from tests.support.images import image_bytes


async def test_a_look_without_counting_refuses_as_an_admission_would_and_counts_nothing(
        ) -> None:
    key = Identity("acme", "key_look", Limits(rpm=2, concurrency=5))
    config = settings()
    window = f"{config.kafka.topic_prefix}:ratelimit:key:key_look:requests"
    async with replicas(config, n=1) as (limiter,):
        for _ in range(3):  # looking leaves the room it found
            await limiter.admit(key, NOBODY, "look", 1, 0, count=False)
        assert await limiter.redis.zcard(window) == 0
        await limiter.admit(key, NOBODY, "one", 1, now_ms() + 60_000)
        await limiter.admit(key, NOBODY, "two", 1, now_ms() + 60_000)
        with pytest.raises(RateLimited, match="limit 2, used 2"):
            await limiter.admit(key, NOBODY, "look", 1, 0, count=False)
        assert await limiter.redis.zcard(window) == 2
    # the local share while Redis is down looks the same way
    local = LocalWindows()
    check = Check(member="m", tokens=1, deadline_ms=now_ms() + 60_000,
                  scopes=(Scope("key:k", "key k", Limits(rpm=1)),))
    assert local.admit(dataclasses.replace(check, member="look"), 1, count=False).admitted
    assert local.admit(check, 1).admitted
    assert not local.admit(dataclasses.replace(check, member="look"), 1, count=False).admitted


async def test_a_caller_with_no_room_has_no_image_fetched_or_stored(tmp_path: Path) -> None:
    """Images are read and stored before admission (their size is counted): the
    limits are looked at first, so a key out of room costs no fetch and no file."""
    fetched: list[str] = []

    async def serve(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.Response(body=image_bytes(), content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = settings(files_dir=tmp_path, images_allowed_hosts=f"127.0.0.1:{port}",
                      images_allow_private_addresses=True)
    registry = Registry.parse('[models."eyes"]\npool = "eyes"\ncontext_length = 8192\n'
                              'vision = true\n', "test")
    key = Identity("acme", "key_eyes", Limits(rpm=1))
    parsed = ChatCompletionRequest.model_validate({"model": "eyes", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"http://127.0.0.1:{port}/cat.png"}}]}]})
    try:
        async with replicas(config, n=1) as (limiter,):
            intake = image_intake(config, registry, Admitter(registry, limiter))
            assert len(await intake.refs(parsed, key)) == 1  # room: fetched and stored
            await limiter.admit(key, NOBODY, "its-admission", 1, now_ms() + 60_000)
            with pytest.raises(RateLimited):
                await intake.refs(parsed, key)
    finally:
        await runner.cleanup()
    assert fetched == ["/cat.png"]
    assert len((await LocalFileStore(config.jobs).list("acme")).data) == 1

"""``build_app``: the FastAPI application, its collaborators and their lifetimes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI

from conveyor.registry import Registry
from conveyor.settings import Settings
from conveyor.tracing import make_tracer
from gateway.api_router import router
from gateway.errors import install_error_handlers
from gateway.replies import ReplyLease, ReplyRouter
from gateway.serving import Serving
from schemas.codec import default_codec
from topics.clients import make_producer

__all__ = ["build_app"]

log = logging.getLogger(__name__)


def build_app(settings: Settings, registry: Registry | None = None) -> FastAPI:
    registry = registry or Registry.load(settings.models_file)
    gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
    background: list[asyncio.Task[None]] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        codec = default_codec()
        redis = aioredis.from_url(settings.redis_url)
        producer = make_producer(settings)
        await producer.start()
        lease = ReplyLease(settings, redis, gateway_id)
        router_ = ReplyRouter(settings, codec, lease)
        await router_.start()
        tracing = make_tracer(settings.trace_exporter, "gateway")
        app.state.serving = Serving(settings, producer, router_, codec, gateway_id,
                                    tracing.tracer)
        background.extend([
            asyncio.create_task(router_.run(), name="replies"),
            asyncio.create_task(lease.keep(), name="reply-lease"),
        ])
        log.info("gateway %s: reply partition %d", gateway_id, router_.partition)
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await router_.stop()
            await producer.stop()
            await redis.aclose()
            tracing.shutdown()

    def health() -> tuple[bool, str]:
        if not background:
            return False, "starting"
        for task in background:
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                return False, f"{task.get_name()} stopped: {exc}"
        return True, gateway_id

    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    app.state.registry = registry
    app.state.health = health
    install_error_handlers(app)
    app.include_router(router)
    return app

"""``build_app``: the FastAPI application, its collaborators and their lifetimes.

The background tasks (the reply-partition lease and the reply follower) live
as long as the application and report in :class:`~gateway.health.Health`,
which ``/healthz`` shows. The Redis client times out its socket operations,
so that a Redis that hangs is an error the lease retries, not a wait for ever.
(Repeated warnings, aiokafka's reconnect lines above all, are held back by
:class:`conveyor.logs.RepeatFilter`, which the CLI puts on every process.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from conveyor.errors import StartupTimeout
from conveyor.files.local import LocalFileStore
from conveyor.redis_clients import Redis, RedisConnectionError, redis_client
from conveyor.registry import Registry
from conveyor.settings import Settings
from conveyor.startup import kafka_address, redis_address, started
from conveyor.tracing import make_tracer
from gateway.admission import Admitter
from gateway.audit import Audit
from gateway.auth.authenticate import Authenticator
from gateway.auth.invalidations import Invalidations
from gateway.auth.jwt_tokens import JwtVerifier
from gateway.auth.keys import KeyStore
from gateway.auth.middleware import AuthMiddleware
from gateway.auth.ratelimit import RateLimiter
from gateway.auth.tenants import TenantStore
from gateway.chat.api_router import router
from gateway.errors import install_error_handlers
from gateway.feedback import feedback_router
from gateway.files.api_router import files_router, upload_limits
from gateway.health import Health
from gateway.jobs.api_router import jobs_router
from gateway.jobs.background import BackgroundResponses
from gateway.jobs.batches import Batches
from gateway.jobs.board import JobBoard
from gateway.limits import BodyLimit
from gateway.metrics_route import install_metrics
from gateway.moderations import moderations_router
from gateway.openapi import install_openapi
from gateway.publisher import Publisher
from gateway.replies import ReplyLease, ReplyRouter
from gateway.responses.api_router import responses_router
from gateway.serving import Serving
from gateway.usage_api import usage_router
from gateway.websocket.api_router import websocket_router
from schemas.codec import default_codec
from topics.clients import make_producer
from topics.models import follow_published
from topics.policies import adopt_policies, follow_policies
from topics.shared_lookup import SharedLookup
from workers.schedule.breakers import Breakers
from workers.usage.ledger import UsageLedger

__all__ = ["build_app", "check_auth_settings"]

log = logging.getLogger(__name__)

_STOP_TASKS_S = 5.0


def build_app(settings: Settings, registry: Registry | None = None,
              on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The gateway's app; ``on_ready`` is called once it has started (its
    collaborators connected), before it serves."""
    check_auth_settings(settings)
    registry = registry or Registry.load(settings.models_file)
    gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
    health = Health(gateway_id)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with _collaborators(app, settings, gateway_id, health):
                if on_ready is not None:
                    on_ready()
                yield
        except StartupTimeout as exc:  # the reason in one line, above uvicorn's traceback
            log.error("gateway %s: %s", gateway_id, exc)
            raise

    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible API in front of an event pipeline.")
    app.state.registry = registry
    app.state.health = health
    # auth=none needs nothing from outside; keys and JWTs wait for the lifespan
    app.state.authenticator = Authenticator(settings) if settings.auth == "none" else None
    app.state.admitter = Admitter(registry)
    app.state.files = LocalFileStore(settings)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       uploads=upload_limits(settings))
    app.add_middleware(AuthMiddleware)  # outside the body limit: 401 before a body is read
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(usage_router)
    app.include_router(feedback_router)
    app.include_router(moderations_router)
    app.include_router(files_router)
    app.include_router(jobs_router)
    app.include_router(websocket_router)
    install_metrics(app, settings)
    app.state.admin_token = settings.admin_token.get_secret_value()
    install_openapi(app)
    return app


@contextlib.asynccontextmanager
async def _collaborators(app: FastAPI, settings: Settings, gateway_id: str,
                         health: Health) -> AsyncIterator[None]:
    codec = default_codec()
    # the gateway's role: short timeouts, one retry on a connection a restart broke
    redis = redis_client(settings, "gateway")
    # the gateway's one producer: requests, cancels, job commands and audit events
    publisher = Publisher(settings, make_producer(settings), codec)
    kafka, within = kafka_address(settings.kafka_bootstrap), settings.startup_timeout_s
    await started("the Kafka producer to connect", publisher.start, within=within, log=log,
                  where=kafka)
    lease = ReplyLease(settings, redis, gateway_id, health.part("reply-lease"))
    router_ = ReplyRouter(settings, codec, lease, health.part("replies"))
    # a refused Redis fails the lease, before anything else is made: tried again
    await started("a reply partition (leased in Redis, then found in Kafka)", router_.start,
                  within=within, log=log, retry_on=(RedisConnectionError,),
                  where=f"{redis_address(settings.redis_url)}, {kafka}")
    tracing = make_tracer(settings.trace_exporter, "gateway")
    lookup = SharedLookup(settings)  # the gateway's one keyed reader of the log
    app.state.serving = Serving(settings, publisher, router_, gateway_id, tracing.tracer,
                                lookup=lookup)
    app.state.serving.metrics = app.state.gateway_metrics
    # `conveyor policies set`: what each tenant's requests may hold (topics/policies.py)
    policies = app.state.serving.policies
    await started("the content policies (conveyor.policies)",
                  lambda: adopt_policies(settings, policies), within=within, log=log,
                  where=kafka)
    audit = Audit(settings, publisher, actor=gateway_id)
    app.state.usage = UsageLedger(settings, redis)
    board = JobBoard(settings, codec)
    app.state.batches = Batches(settings, publisher, board, app.state.files)
    breakers = Breakers.of(settings)  # the fleet's breakers, as /healthz shows them
    health.extras["breakers"] = breakers.report
    health.tasks.extend([
        asyncio.create_task(breakers.follow(), name="breakers"),
        # `conveyor models apply`: the registry every route here serves by
        asyncio.create_task(follow_published(settings, app.state.registry), name="models"),
        asyncio.create_task(follow_policies(settings, policies), name="policies"),
        asyncio.create_task(router_.run(), name="replies"),
        asyncio.create_task(lease.keep(), name="reply-lease"),
        asyncio.create_task(board.run(health.part("jobs")), name="jobs"),
    ])
    if settings.auth != "none":
        _identity(app, settings, redis, audit, gateway_id, health)
    app.state.background_responses = BackgroundResponses(settings, publisher, board,
                                                         app.state.admitter, policies)
    log.info("gateway %s: reply partition %d", gateway_id, router_.partition)
    try:
        yield
    finally:
        stopping = time.monotonic()
        log.info("gateway %s: stopping", gateway_id)
        for task in health.tasks:
            task.cancel()
        # bounded: a background task whose Kafka client will not let go of its
        # cancel must not keep the gateway from stopping
        ended, stuck = await asyncio.wait(health.tasks, timeout=_STOP_TASKS_S) \
            if health.tasks else (set(), set())
        for task in ended:  # their outcome read: a task that failed says so in /healthz
            _ = task.cancelled() or task.exception()
        if stuck:
            log.warning("gateway %s: %s did not stop within %.0f s; left behind", gateway_id,
                        ", ".join(sorted(t.get_name() for t in stuck)), _STOP_TASKS_S)
        await router_.stop()
        await lookup.close()
        await app.state.admitter.drain()
        await publisher.close()  # what must arrive (cancels) has produce_timeout_s to go
        await redis.aclose()
        tracing.shutdown()
        log.info("gateway %s: stopped in %.1f s", gateway_id, time.monotonic() - stopping)


def _identity(app: FastAPI, settings: Settings, redis: Redis, audit: Audit,
              gateway_id: str, health: Health) -> None:
    """Keys or JWTs, tenants and limits, with their background tasks. The key and
    tenant caches share one pub/sub subscription for their invalidations."""
    invalidations = Invalidations(settings, redis)
    tenants = TenantStore(settings, redis, invalidations=invalidations)
    keys: KeyStore | None = None
    tokens: JwtVerifier | None = None
    if settings.auth == "keys":
        keys = KeyStore(settings, redis, audit=audit, invalidations=invalidations)
    else:
        tokens = JwtVerifier(settings)
    health.tasks.append(asyncio.create_task(
        invalidations.run(health.part("key-cache")), name="key-cache"))
    limiter = RateLimiter(settings, redis, gateway_id)
    health.tasks.append(asyncio.create_task(limiter.run(health.part("limits")), name="limits"))
    app.state.authenticator = Authenticator(settings, keys=keys, tokens=tokens, audit=audit,
                                            actor=gateway_id)
    app.state.admitter = Admitter(app.state.registry, limiter, tenants, audit,
                                  actor=gateway_id)


def check_auth_settings(settings: Settings) -> None:
    """Fail at start, with a message, on an auth configuration that cannot work."""
    if settings.auth == "keys" and not settings.auth_secret.get_secret_value():
        raise ValueError("CONVEYOR_AUTH=keys needs CONVEYOR_AUTH_SECRET: the server secret "
                         "API keys are hashed with")
    if settings.auth == "jwt":
        JwtVerifier(settings)

"""``build_app``: the FastAPI application, its services and their lifetimes. The
lifespan connects the collaborators and makes the
:class:`~gateway.services.Services` routes are handed; the background tasks
live as long as the application and report in :class:`~gateway.health.Health`
(``/healthz``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI
from starlette.types import Scope

from conveyor.errors import StartupTimeout
from conveyor.files.images import ImageStore
from conveyor.files.local import LocalFileStore
from conveyor.metrics import GatewayMetrics
from conveyor.policy.rules import PolicyBook
from conveyor.redis_clients import Redis, RedisConnectionError, redis_client
from conveyor.registry import Registry
from conveyor.settings import Settings
from conveyor.startup import kafka_address, redis_address, started
from gateway.admission import Admitter
from gateway.audit import Audit
from gateway.auth.authenticate import Authenticator
from gateway.auth.cache import Invalidations
from gateway.auth.jwt_tokens import JwtVerifier
from gateway.auth.keys import KeyStore
from gateway.auth.middleware import AuthMiddleware
from gateway.auth.ratelimit import RateLimiter
from gateway.auth.tenants import TenantStore
from gateway.cancels import Cancels, ResumeWatch
from gateway.chat.api_router import router
from gateway.chat.serving import ChatServing
from gateway.console.api_router import console_router, console_static
from gateway.embeddings.api_router import embeddings_router
from gateway.errors import install_error_handlers
from gateway.feedback import feedback_router
from gateway.files.api_router import files_router, upload_limits
from gateway.health import Health
from gateway.images import ImageIntake
from gateway.jobs.api_router import jobs_router
from gateway.jobs.background import BackgroundResponses
from gateway.jobs.batches import Batches
from gateway.jobs.board import JobBoard
from gateway.limits import BodyLimit
from gateway.messages.api_router import messages_router
from gateway.messages.errors import AnthropicErrors
from gateway.messages.serving import MessagesServing
from gateway.metrics_route import install_metrics
from gateway.moderations import moderations_router
from gateway.openapi import install_openapi
from gateway.publisher import Publisher
from gateway.replies import ReplyLease, ReplyRouter
from gateway.responses.api_router import responses_router
from gateway.responses.serving import ResponsesServing
from gateway.services import Services
from gateway.stored import StoredAnswers
from gateway.submission import Submitter
from gateway.usage_api import usage_router
from gateway.websocket.api_router import websocket_router
from schemas.codec import default_codec
from topics.clients import make_producer
from topics.groups import GroupReader
from topics.lookup import SharedLookup
from topics.models import follow_published
from topics.policies import adopt_policies, follow_policies
from topics.producer import Producer
from topics.tracing import make_tracer
from workers.fleet import Fleet
from workers.usage.ledger import UsageLedger
from workers.usage.requests import RequestIndex

__all__ = ["build_app", "check_auth_settings"]

log = logging.getLogger(__name__)

_STOP_TASKS_S = 5.0


def build_app(settings: Settings, registry: Registry | None = None,
              on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The gateway's app; ``on_ready`` is called once it has started (its
    services made), before it serves."""
    check_auth_settings(settings)
    known = registry or Registry.load(settings.process.models_file)
    gateway_id = settings.gateway.id or f"gw-{uuid.uuid4().hex[:12]}"
    health = Health(gateway_id)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with _services(settings, known, gateway_id, health, metrics) as services:
                app.state.services = services
                if on_ready is not None:
                    on_ready()
                yield
        except StartupTimeout as exc:  # the reason in one line, above uvicorn's traceback
            log.error("gateway %s: %s", gateway_id, exc)
            raise

    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible API in front of an event pipeline.")
    app.add_middleware(BodyLimit, max_bytes=settings.gateway.max_body_bytes,
                       uploads=upload_limits(settings.jobs),
                       collected=partial(_body_limit, settings, known))
    # outside the body limit: 401 before a body is read
    app.add_middleware(AuthMiddleware, authenticator=_authenticator)
    install_error_handlers(app)
    # outside every other: errors on /v1/messages in Anthropic's shape
    app.add_middleware(AnthropicErrors)
    # the Responses router before the jobs router: GET /v1/responses/{id} is its
    for api in (router, embeddings_router, responses_router, messages_router, usage_router,
                feedback_router,
                moderations_router, files_router, jobs_router, websocket_router, console_router):
        app.include_router(api)
    app.mount("/console/static", console_static, name="console-static")
    _, metrics = install_metrics(app, settings)
    install_openapi(app)
    return app


def _authenticator(scope: Scope) -> Authenticator | None:
    services: Services | None = getattr(scope["app"].state, "services", None)
    return services.authenticator if services is not None else None


@contextlib.asynccontextmanager
async def _services(settings: Settings, registry: Registry, gateway_id: str, health: Health,
                    metrics: GatewayMetrics) -> AsyncIterator[Services]:
    codec = default_codec()
    # the gateway's role: short timeouts, one retry on a connection a restart broke
    redis = redis_client(settings.redis, "gateway")
    # the gateway's one producer: requests, cancels, job commands and audit events
    publisher = Publisher(settings, make_producer(settings.kafka), codec)
    kafka, within = kafka_address(settings.kafka.bootstrap), settings.process.startup_timeout_s
    await started("the Kafka producer to connect", publisher.start, within=within, log=log,
                  where=kafka)
    lease = ReplyLease(settings, redis, gateway_id, health.part("reply-lease"))
    router_ = ReplyRouter(settings, codec, lease, health.part("replies"))
    # a refused Redis fails the lease, before anything else is made: tried again
    await started("a reply partition (leased in Redis, then found in Kafka)", router_.start,
                  within=within, log=log, retry_on=(RedisConnectionError,),
                  where=f"{redis_address(settings.redis.url)}, {kafka}")
    tracing = make_tracer(settings.telemetry.trace_exporter, "gateway")
    lookup = SharedLookup(settings)  # the gateway's one keyed reader of the log
    # `conveyor policies set`: what each tenant's requests may hold (topics/policies.py)
    policies = PolicyBook()
    await started("the content policies (conveyor.policies)",
                  lambda: adopt_policies(settings, policies), within=within, log=log,
                  where=kafka)
    audit = Audit(settings, publisher, actor=gateway_id)
    board = JobBoard(settings, codec)
    # every worker's heartbeat and breaker, as the console and /healthz show them
    fleet = Fleet(settings)
    health.extras["breakers"] = fleet.breakers.report
    health.tasks.extend([
        asyncio.create_task(fleet.follow(), name="fleet"),
        # `conveyor models apply`: the registry every route here serves by
        asyncio.create_task(follow_published(settings, registry), name="models"),
        asyncio.create_task(follow_policies(settings, policies), name="policies"),
        asyncio.create_task(router_.run(), name="replies"),
        asyncio.create_task(lease.keep(), name="reply-lease"),
        asyncio.create_task(board.run(health.part("jobs")), name="jobs"),
    ])
    authenticator, admitter = _identity(settings, registry, redis, publisher.producer, audit,
                                        gateway_id, health)
    cancels = Cancels(settings, publisher, ResumeWatch(settings, redis))
    submitter = Submitter(settings, publisher, router_, cancels, admitter, policies,
                          gateway_id, tracing.tracer, metrics)
    stored = StoredAnswers(settings, lookup, codec)
    files = LocalFileStore(settings.jobs)
    image_store = ImageStore(files)
    images = ImageIntake(settings.images, image_store, registry, admitter)
    health.tasks.append(asyncio.create_task(
        image_store.keep_swept(settings.images.retention_days * 86_400), name="image-retention"))
    background = BackgroundResponses(settings, publisher, board, admitter, policies)
    services = Services(
        settings=settings, health=health, registry=registry, authenticator=authenticator,
        policies=policies, publisher=publisher, submitter=submitter, stored=stored,
        chat=ChatServing(settings, submitter, stored, registry, images),
        responses=ResponsesServing(settings, submitter, stored, background, images),
        messages=MessagesServing(settings, submitter, registry),
        files=files, batches=Batches(settings, publisher, board, files),
        background=background, usage=UsageLedger(settings, redis),
        requests=RequestIndex(settings, redis), fleet=fleet, lookup=lookup,
        groups=GroupReader(settings))
    log.info("gateway %s: reply partition %d", gateway_id, router_.partition)
    try:
        yield services
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
        await services.groups.close()
        await admitter.drain()
        await publisher.close()  # what must arrive (cancels) has produce_timeout_s to go
        await redis.aclose()
        tracing.shutdown()
        log.info("gateway %s: stopped in %.1f s", gateway_id, time.monotonic() - stopping)


def _body_limit(settings: Settings, registry: Registry, path: str) -> int:
    """A request body's limit: images' (data URLs are large) on the routes that
    take them while the live registry has a model that reads them, else the
    gateway's."""
    if path in _IMAGE_ROUTES and any(m.vision for m in registry.models.values()):
        return max(settings.gateway.max_body_bytes, settings.images.max_body_bytes)
    return settings.gateway.max_body_bytes


_IMAGE_ROUTES = ("/v1/chat/completions", "/v1/responses")


def _identity(settings: Settings, registry: Registry, redis: Redis, producer: Producer,
              audit: Audit, gateway_id: str, health: Health) -> tuple[Authenticator, Admitter]:
    """Who is asking, and what they may send: keys or JWTs, tenants and limits,
    with their background tasks (none without auth). The key and tenant caches
    share one pub/sub subscription for their invalidations; the key store writes
    through the gateway's producer (the console creates and revokes keys)."""
    if settings.auth.mode == "none":
        return Authenticator(settings), Admitter(registry)
    invalidations = Invalidations(settings, redis)
    tenants = TenantStore(settings, redis, invalidations=invalidations)
    keys: KeyStore | None = None
    tokens: JwtVerifier | None = None
    if settings.auth.mode == "keys":
        keys = KeyStore(settings, redis, producer, audit=audit, invalidations=invalidations)
    else:
        tokens = JwtVerifier(settings)
    health.tasks.append(asyncio.create_task(
        invalidations.run(health.part("key-cache")), name="key-cache"))
    limiter = RateLimiter(settings, redis, gateway_id)
    health.tasks.append(asyncio.create_task(limiter.run(health.part("limits")), name="limits"))
    return (Authenticator(settings, keys=keys, tokens=tokens, audit=audit, actor=gateway_id),
            Admitter(registry, limiter, tenants, audit, actor=gateway_id))


def check_auth_settings(settings: Settings) -> None:
    """Fail at start, with a message, on an auth configuration that cannot work."""
    if settings.auth.mode == "keys" and not settings.auth.secret.get_secret_value():
        raise ValueError("CONVEYOR_AUTH=keys needs CONVEYOR_AUTH_SECRET: the server secret "
                         "API keys are hashed with")
    if settings.auth.mode == "jwt":
        JwtVerifier(settings)

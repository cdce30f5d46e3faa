"""Submitting a request, for every generation route: the generation admitted,
redacted where its policy asks, put on ``conveyor.requests`` with its
deadline, trace and reply address; what comes back is its
:class:`~gateway.answer.Answer`. Kafka not taking it within
``produce_timeout_s``, or unreachable, is a 503 at once; too large is a 413."""

from __future__ import annotations

import hashlib
import time

from opentelemetry import trace
from starlette.requests import HTTPConnection

from conveyor.errors import InvalidRequest, PipelineUnavailable
from conveyor.metrics import GatewayMetrics
from conveyor.policy.pii import FindMemo
from conveyor.policy.rules import PolicyBook
from conveyor.settings import Settings
from gateway.admission import FREE, Admitter, Ticket
from gateway.answer import Answer
from gateway.auth.authenticate import ANONYMOUS
from gateway.auth.middleware import identity_of
from gateway.auth.types import Identity
from gateway.cancels import Cancels
from gateway.errors import safe_json
from gateway.pii import ReplyRestorer
from gateway.publisher import NotTakenInTime, Publisher
from gateway.replies import ReplyRouter
from schemas.records import Generation, Request
from topics.catalog import REQUESTS
from topics.envelope import new_envelope, new_request_id, now_ms
from topics.tracing import genai_request_attributes, layer_span, trace_id_of
from workers.policy_checks import redacted
from workers.prompt_cache import cacheable

__all__ = ["Submitter", "TIMEOUT_HEADER"]

TIMEOUT_HEADER = "X-Conveyor-Timeout"


class Submitter:
    """Puts callers' generations on ``conveyor.requests`` and opens their answers
    on this gateway's reply partition."""

    def __init__(self, settings: Settings, publisher: Publisher, router: ReplyRouter,
                 cancels: Cancels, admitter: Admitter, policies: PolicyBook,
                 gateway_id: str, tracer: trace.Tracer | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.publisher = publisher
        self.router = router
        self.cancels = cancels
        self.admitter = admitter
        # the content policies, kept current by the lifespan (topics/policies.py)
        self.policies = policies
        self.gateway_id = gateway_id
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or GatewayMetrics.off()
        # what redaction found in texts it searched lately (conversations resend them)
        self.find_memo = FindMemo()

    async def admit_and_submit(self, generation: Generation,
                               request: HTTPConnection) -> Answer:
        """Admit (model access, limits) the caller's generation, then submit it with
        the request's deadline and trace; the answer's ticket holds the admission's
        ``x-ratelimit-*`` headers. ``request`` is a WebSocket's handshake too."""
        identity = identity_of(request)
        timeout_s = _timeout(request)
        rid = new_request_id()
        ticket = await self.admitter.admit(identity, generation, rid,
                                           self.deadline_ms(timeout_s))
        try:
            return await self.submit(generation, identity, timeout_s=timeout_s,
                                     traceparent=request.headers.get("traceparent"),
                                     request_id=rid, ticket=ticket)
        except BaseException:
            ticket.settle(None, produced=False)
            raise

    def deadline_ms(self, timeout_s: float | None) -> int:
        return now_ms() + int((timeout_s or self.settings.gateway.request_timeout_s) * 1000)

    async def submit(self, generation: Generation, identity: Identity = ANONYMOUS,
                     timeout_s: float | None = None, traceparent: str | None = None,
                     request_id: str | None = None, ticket: Ticket = FREE) -> Answer:
        """Put the request on ``conveyor.requests``, continuing the client's
        ``traceparent``; ``ticket`` is settled when the answer is closed."""
        started = time.monotonic()
        if self.router.kafka_unreachable():
            raise PipelineUnavailable("The pipeline is unavailable (Kafka does not answer); "
                                      "try again later.")
        rid = request_id or new_request_id()
        timeout = timeout_s or self.settings.gateway.request_timeout_s
        policy = self.policies.effective(identity.tenant, identity.key_id)
        restorer: ReplyRestorer | None = None
        if policy.redact:  # before anything is written (gateway/pii.py)
            generation, redactor = await redacted(generation, policy, self.find_memo)
            if policy.restore and redactor.mapping:
                restorer = ReplyRestorer(redactor.mapping)
        envelope = new_envelope(rid, reply_gateway=self.gateway_id,
                                reply_partition=self.router.partition, tenant=identity.tenant,
                                key_id=identity.key_id,
                                deadline_ms=now_ms() + int(timeout * 1000),
                                traceparent=traceparent if _valid_traceparent(traceparent)
                                else None)
        stream = self.router.open(rid)
        try:
            with layer_span(self.tracer, "gateway", envelope) as span:
                span.set_attributes(genai_request_attributes(generation))
                await self._produce_request(Request(envelope=envelope, generation=generation))
        except BaseException:
            self.router.close(rid)
            raise
        access = {"tenant": identity.tenant, "key": identity.key_id or "-",
                  "model": generation["model"], "kind": generation["kind"],
                  "stream": generation["stream"], "prompt_sha256": _prompt_hash(generation),
                  "trace": trace_id_of(envelope)}
        answer = Answer(stream, started + timeout, self.router, self.cancels, self.metrics,
                        access, ticket, restorer)
        answer.started = started
        if policy.cache and cacheable(generation):
            answer.cache = "miss"
        return answer

    async def _produce_request(self, request: Request) -> None:
        """Produce the Request event, waiting at most ``produce_timeout_s``: a broker
        that is down answers 503 at once rather than after aiokafka's 30 s. The event
        may still be delivered after the wait gave up, so a cancel follows it."""
        envelope = request["envelope"]
        rid = envelope["request_id"]
        try:
            await self.publisher.publish(
                REQUESTS, request, rid, what="the request",
                headers=[("traceparent", envelope["traceparent"].encode())])
        except NotTakenInTime:
            self.cancels.cancel(rid, "the request could not be produced in time",
                                deadline_ms=envelope["deadline_ms"] or None)
            raise


def _timeout(request: HTTPConnection) -> float | None:
    """``X-Conveyor-Timeout``: the request's deadline in seconds (the default otherwise)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be a number of seconds in (0, 3600].",
                             param=TIMEOUT_HEADER)
    return value


def _prompt_hash(generation: Generation) -> str:
    ask = generation.get("embedding")
    prompt = generation["prompt"] if generation["kind"] == "completion" else \
        ask["inputs"] if ask else [[m["role"], m["content"]] for m in generation["messages"]]
    return hashlib.sha256(safe_json(prompt)).hexdigest()[:16]


def _valid_traceparent(value: str | None) -> bool:
    parts = value.split("-") if value else []
    return len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16

"""Serving a request: turn it into a ``conveyor.requests`` event, then answer
from the replies that come back, as JSON or as an SSE stream.

A stream starts only when the first reply is in, so a request that fails
before its first token still gets the right HTTP status and OpenAI's error
envelope. A deadline (``request_timeout_s``) bounds every wait: past it the
client gets 504 and the generation is cancelled. A client that disconnects
cancels its generation too: at once before the stream began (it has seen no
event id to resume from), and after ``resume_grace_s`` once it streamed, unless
a resumed stream (:mod:`gateway.resume`) is reading it by then. Every data
event carries ``id: {request id}:{seq}``; :func:`gateway.resume.resumed_events`
serves the events after one from the log, on any replica.

What the pipeline cannot take is refused before it enters: a body over
``max_body_bytes`` never reaches here (:mod:`gateway.limits`), and an encoded
event over ``max_event_bytes`` (or one the broker refuses as too large) is a
413. A broker that does not take the request within ``produce_timeout_s``, or
that the reply follower sees as unreachable, is a 503 ``pipeline_unavailable``
at once: the client hears "the pipeline is unavailable", not a wait that ends
in a misleading ``no_worker_available``. Requests and cancels reach Kafka
through the gateway's :class:`~gateway.publisher.Publisher`: a request on the
request's path, a cancel as a send that must arrive.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace

from conveyor.errors import PipelineUnavailable, RequestError
from conveyor.metrics import GatewayMetrics
from conveyor.policy.pii import FindMemo
from conveyor.policy.rules import PolicyBook
from conveyor.settings import Settings
from conveyor.tracing import genai_request_attributes, layer_span, trace_id_of
from gateway import sse
from gateway.admission import FREE, Ticket
from gateway.answer import Answer, Disconnected, collect
from gateway.auth.authenticate import ANONYMOUS
from gateway.auth.types import Identity
from gateway.cancels import Cancels, ResumeWatch
from gateway.pii import ReplyRestorer
from gateway.publisher import NotTakenInTime, Publisher
from gateway.replies import ReplyRouter
from gateway.resume import ReplySource, event_id
from schemas.openai.generations import chat_generation, completion_generation
from schemas.openai.requests import ChatCompletionRequest, CompletionRequest
from schemas.records import Generation, Reply, Request
from topics.catalog import REQUESTS
from topics.envelope import new_envelope, new_request_id, now_ms
from topics.shared_lookup import SharedLookup
from workers.policy_checks import redacted
from workers.prompt_cache import cacheable

__all__ = ["Serving", "Answer"]

log = logging.getLogger(__name__)


class Serving:
    def __init__(self, settings: Settings, publisher: Publisher, router: ReplyRouter,
                 gateway_id: str, tracer: trace.Tracer | None = None,
                 lookup: SharedLookup | None = None) -> None:
        self.settings = settings
        self.publisher = publisher
        # the gateway's one keyed lookup (resumes, stored answers); build_app closes it
        self.lookup = lookup or SharedLookup(settings)
        self.router = router
        self.codec = publisher.codec
        self.gateway_id = gateway_id
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = GatewayMetrics.off()  # build_app sets the process's
        self._cancels: Cancels | None = None
        # the content policies, kept current by build_app (topics/policies.py)
        self.policies = PolicyBook()
        # what redaction found in texts it searched lately (conversations resend them)
        self.find_memo = FindMemo()

    @property
    def cancels(self) -> Cancels:
        """Cancels, asking who reads resumed streams in the Redis the reply lease uses."""
        if self._cancels is None:
            self._cancels = Cancels(self.settings, self.publisher,
                                    ResumeWatch(self.settings, self.router.lease.redis))
        return self._cancels

    @property
    def watch(self) -> ResumeWatch:
        return self.cancels.watch

    def resume_frames(self, replies: ReplySource, after: int) -> AsyncIterator[bytes]:
        """A resumed chat/completions stream's events (a :data:`gateway.resume.Framer`)."""
        return self.frames(replies, None, after)

    # -- submission -------------------------------------------------------

    def chat_generation(self, body: ChatCompletionRequest) -> Generation:
        return chat_generation(body)

    def completion_generation(self, body: CompletionRequest) -> Generation:
        return completion_generation(body)

    @staticmethod
    def new_request_id() -> str:
        return new_request_id()

    def deadline_ms(self, timeout_s: float | None) -> int:
        return now_ms() + int((timeout_s or self.settings.request_timeout_s) * 1000)

    async def submit(self, generation: Generation, identity: Identity = ANONYMOUS,
                     timeout_s: float | None = None, traceparent: str | None = None,
                     request_id: str | None = None, ticket: Ticket = FREE) -> Answer:
        """Put the request on ``conveyor.requests``; ``traceparent`` continues the
        client's trace (W3C header), else the request starts its own. The caller's
        tenant and key id travel in the envelope; ``ticket`` is settled when the
        answer is closed."""
        started = time.monotonic()
        if self.router.kafka_unreachable():
            raise PipelineUnavailable("The pipeline is unavailable (Kafka does not answer); "
                                      "try again later.")
        rid = request_id or self.new_request_id()
        timeout = timeout_s or self.settings.request_timeout_s
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
            self.cancel(rid, "the request could not be produced in time",
                        deadline_ms=envelope["deadline_ms"] or None)
            raise

    def cancel(self, request_id: str, reason: str, grace_s: float = 0.0,
               reader: str | None = None, deadline_ms: int | None = None) -> None:
        self.cancels.cancel(request_id, reason, grace_s, reader, deadline_ms)

    # -- answers ------------------------------------------------------------

    async def collect(self, generation: Generation, answer: Answer,
                      disconnected: Disconnected, read_calls: bool = True) -> dict[str, Any]:
        return await collect(generation, answer, disconnected, read_calls)

    async def first(self, answer: Answer, disconnected: Disconnected) -> Reply | None:
        return await answer.first(disconnected)

    async def stream(self, answer: Answer, first: Reply) -> AsyncIterator[bytes]:
        """SSE frames: OpenAI chunks, keep-alive comments while waiting, then [DONE].
        Closing the iterator early (the client went away) cancels the generation
        after ``resume_grace_s``, unless a resumed stream reads it by then."""
        ended = False
        try:
            async for frame in self.frames(answer, first, after=-1):
                yield frame
            ended = True
        finally:
            resumable = self.settings.resumable_streams and not ended
            answer.close("client disconnected",
                         grace_s=self.settings.resume_grace_s if resumable else 0.0)

    async def frames(self, source: ReplySource, first: Reply | None,
                      after: int) -> AsyncIterator[bytes]:
        """Data events numbered from 0 (``id: {request id}:{seq}``), those after
        ``after`` sent; keep-alive comments while waiting; an error as an event."""
        keepalive = self.settings.sse_keepalive_s
        rid = source.request_id
        ids = self.settings.resumable_streams
        seq = -1
        reply: Reply | None = first
        while True:
            if reply is None:
                yield sse.comment()
            else:
                # a reply's events go out in one write: a socket write costs more
                # than the bytes in it (on loopback, the receiver's work too)
                frames = []
                for chunk in reply["chunk"].split("\n") if reply["chunk"] else ():
                    seq += 1
                    if seq > after:
                        frames.append(sse.data(chunk, id=event_id(rid, seq) if ids else None))
                if reply["kind"] == "final":
                    yield sse.Last(b"".join(frames) + sse.DONE)
                    return
                if frames:
                    yield b"".join(frames)
            try:
                reply = await source.next(within=keepalive)
            except Exception as exc:  # the status is sent: the error becomes an event
                if not isinstance(exc, RequestError):
                    log.error("stream %s failed", rid, exc_info=exc)
                    exc = RequestError("Internal error.")
                seq += 1
                if seq > after:
                    yield sse.data(_json(exc.envelope()),
                                   id=event_id(rid, seq) if ids else None)
                yield sse.Last(sse.DONE)
                return


def _prompt_hash(generation: Generation) -> str:
    prompt = generation["prompt"] if generation["kind"] == "completion" else [
        [m["role"], m["content"]] for m in generation["messages"]]
    return hashlib.sha256(_json(prompt).encode()).hexdigest()[:16]


def _valid_traceparent(value: str | None) -> bool:
    parts = value.split("-") if value else []
    return len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

"""Admission: may this caller send this request now? The model must be one the
caller's key allows (else 404, as if it did not exist), then the limits and
quotas of the key and its tenant must have room (:mod:`gateway.auth.ratelimit`).
A :class:`Ticket` is the grant: its headers go on the response and
:meth:`Ticket.settle` gives back what the answer did not use.

Tokens are reserved before preprocess tokenizes the prompt: one per
:data:`CHARS_PER_TOKEN` characters (about BPE's average on English; settling
corrects it), plus each image's tokens (conveyor/images.py), plus
``max_tokens`` or else the model's context length."""

from __future__ import annotations

import asyncio
import logging

from conveyor.errors import (
    ModelNotFound,
    PipelineUnavailable,
    QuotaExceeded,
    RateLimited,
    TransientBrokerError,
)
from conveyor.images import image_tokens
from conveyor.registry import Registry
from gateway.audit import Audit
from gateway.auth.ratelimit import Admission, RateLimiter
from gateway.auth.tenants import TenantStore
from gateway.auth.types import Identity, TenantPolicy
from schemas.records import Generation, Usage

__all__ = ["Admitter", "Ticket", "CHARS_PER_TOKEN", "estimate_tokens", "model_not_found"]

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
_AUDIT_EVERY_S = 1.0


def estimate_tokens(generation: Generation, registry: Registry) -> int:
    """Prompt tokens (estimated from characters, and each image's as counted
    for OpenAI) plus the tokens it may generate."""
    ask = generation.get("embedding")
    if generation["kind"] == "embedding" and ask:  # nothing generated; ids are tokens
        return sum(-(-len(i) // CHARS_PER_TOKEN) + 2 if isinstance(i, str) else len(i) + 2
                   for i in ask["inputs"])
    images = 0
    if generation["kind"] == "chat":
        chars = sum(len(m["content"]) + len(m["role"]) + 4 for m in generation["messages"])
        images = sum(image_tokens(r["width"], r["height"], r.get("detail") or "auto")
                     for m in generation["messages"] for r in m.get("images") or ())
    else:
        chars = len(generation["prompt"] or "")
    prompt = -(-chars // CHARS_PER_TOKEN) + 1 + images
    budget = generation["sampling"]["max_tokens"]
    if budget is None:
        spec = registry.find(generation["model"])
        budget = max(1, (spec.context_length if spec else 4096) - prompt)
    return prompt + budget


class Ticket:
    """One admitted request's grant: its response headers, and the settlement."""

    def __init__(self, admitter: Admitter | None = None,
                 admission: Admission | None = None) -> None:
        self.admitter = admitter
        self.admission = admission
        self.headers: dict[str, str] = dict(admission.headers) if admission else {}
        self._settled = False

    def settle(self, usage: Usage | None, produced: bool) -> None:
        """The answer ended: count what it really used (usage), keep the whole
        reservation when the answer ended unknown after tokens went out, or give
        it all back when it failed before any (``produced`` false)."""
        if self._settled or self.admitter is None or self.admission is None:
            return
        self._settled = True
        if usage is not None:
            used = usage["prompt_tokens"] + usage["completion_tokens"]
        else:
            used = self.admission.tokens if produced else 0  # the reservation
        self.admitter.settle_later(self.admission, used)


FREE = Ticket()


def model_not_found(model: str) -> ModelNotFound:
    return ModelNotFound(f"The model `{model}` does not exist or you do not have "
                         "access to it.", param="model")


class Admitter:
    def __init__(self, registry: Registry, limiter: RateLimiter | None = None,
                 tenants: TenantStore | None = None, audit: Audit | None = None,
                 actor: str = "") -> None:
        self.registry = registry
        self.limiter = limiter
        self.tenants = tenants
        self.audit = audit
        self.actor = actor
        self._settling: set[asyncio.Task[None]] = set()

    async def admit(self, identity: Identity, generation: Generation, request_id: str,
                    deadline_ms: int) -> Ticket:
        model = generation["model"]
        self.check_model(identity, model)
        if self.limiter is None or not identity.key_id:
            return FREE
        tokens = estimate_tokens(generation, self.registry)
        return Ticket(self, await self._limited(identity, model, request_id, tokens,
                                                deadline_ms))

    def check_model(self, identity: Identity, model: str) -> None:
        """404 for a model the caller's key does not allow, as for one that does not exist."""
        spec = self.registry.find(model)
        if not identity.may_use(model) and not (spec and identity.may_use(spec.name)):
            raise model_not_found(model)

    async def may_start(self, identity: Identity, model: str) -> None:
        """Refuse now (429, or 503 while limits cannot be checked) a caller whose
        key or tenant has no room left for one more request of the least size,
        counting nothing: asked before the work a request costs ahead of its
        admission (reading and storing its images), which the limits gate too.
        The refusal is audited without a request id: no request was made."""
        if self.limiter is not None and identity.key_id:
            await self._limited(identity, model, "", 1, 0, count=False)

    async def _limited(self, identity: Identity, model: str, request_id: str, tokens: int,
                       deadline_ms: int, count: bool = True) -> Admission:
        assert self.limiter is not None
        try:
            tenant = (await self.tenants.get(identity.tenant) if self.tenants is not None
                      else TenantPolicy(identity.tenant))
        except TransientBrokerError as exc:  # Redis down and the policy not cached
            raise PipelineUnavailable("Limits cannot be checked now (Redis does not "
                                      "answer); try again later.") from exc
        try:
            return await self.limiter.admit(identity, tenant, request_id, tokens,
                                            deadline_ms, count=count)
        except (RateLimited, QuotaExceeded) as exc:
            self._audit_rejection(identity, exc, request_id, model)
            raise

    def _audit_rejection(self, identity: Identity, exc: RateLimited | QuotaExceeded,
                         request_id: str, model: str) -> None:
        if self.audit is None:
            return
        action = "quota.rejected" if isinstance(exc, QuotaExceeded) else "limit.rejected"
        self.audit.record_throttled(f"{action}:{identity.key_id}", _AUDIT_EVERY_S, action,
                                    tenant=identity.tenant, key_id=identity.key_id,
                                    actor=self.actor, reason=exc.message,
                                    request_id=request_id, detail={"model": model})

    def settle_later(self, admission: Admission, used: int) -> None:
        """Settle in the background: it is asked for when a response ends, often
        from a response that is being cancelled (the client left)."""
        assert self.limiter is not None
        task = asyncio.create_task(self.limiter.settle(admission, used))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def drain(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

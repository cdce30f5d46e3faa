"""Admission: may this caller send this request now?

In order: the model must be one the caller's key allows (else 404, as if the
model did not exist), then the rate limits and quotas of the key and of its
tenant must have room (:mod:`gateway.auth.ratelimit`, exact across gateway
replicas). A :class:`Ticket` is what admission granted: its headers go on
the response, and :meth:`Ticket.settle` gives back what the request did not
use when its answer ends.

Tokens are reserved before the prompt is tokenized (that happens in the
preprocess layer): the gateway counts a prompt as one token per
:data:`CHARS_PER_TOKEN` characters (about what BPE tokenizers average on
English; settling corrects it to the real count), plus ``max_tokens``, or
the model's context length when the request sets no ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from conveyor.errors import (
    ModelNotFound,
    PipelineUnavailable,
    QuotaExceeded,
    RateLimited,
    TransientBrokerError,
)
from conveyor.registry import Registry
from gateway.audit import Audit
from gateway.auth.authenticate import TenantLookup
from gateway.auth.types import Identity, TenantPolicy
from schemas.records import Generation, Usage

__all__ = ["Admitter", "Ticket", "Limiter", "CHARS_PER_TOKEN", "estimate_tokens"]

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
_AUDIT_EVERY_S = 1.0
_AUDIT_MEMORY = 4096


class Limiter(Protocol):
    async def admit(self, identity: Identity, tenant: TenantPolicy, request_id: str,
                    tokens: int, deadline_ms: int) -> Any: ...

    async def settle(self, admission: Any, used_tokens: int) -> None: ...


def estimate_tokens(generation: Generation, registry: Registry) -> int:
    """Prompt tokens (estimated from characters) plus the tokens it may generate."""
    if generation["kind"] == "chat":
        chars = sum(len(m["content"]) + len(m["role"]) + 4 for m in generation["messages"])
    else:
        chars = len(generation["prompt"] or "")
    prompt = -(-chars // CHARS_PER_TOKEN) + 1
    budget = generation["sampling"]["max_tokens"]
    if budget is None:
        spec = registry.find(generation["model"])
        budget = max(1, (spec.context_length if spec else 4096) - prompt)
    return prompt + budget


class Ticket:
    """One admitted request's grant: its response headers, and the settlement."""

    def __init__(self, admitter: Admitter | None = None, admission: Any = None,
                 reserved: int = 0) -> None:
        self.admitter = admitter
        self.admission = admission
        self.reserved = reserved
        self.headers: dict[str, str] = dict(getattr(admission, "headers", None) or {})
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
            used = self.reserved if produced else 0
        self.admitter.settle_later(self.admission, used)


FREE = Ticket()


class Admitter:
    def __init__(self, registry: Registry, limiter: Limiter | None = None,
                 tenants: TenantLookup | None = None, audit: Audit | None = None,
                 actor: str = "") -> None:
        self.registry = registry
        self.limiter = limiter
        self.tenants = tenants
        self.audit = audit
        self.actor = actor
        self._settling: set[asyncio.Task[None]] = set()
        # (key id, action) -> (last audited, rejections held back since)
        self._rejections: dict[tuple[str, str], tuple[float, int]] = {}

    async def admit(self, identity: Identity, generation: Generation, request_id: str,
                    deadline_ms: int) -> Ticket:
        model = generation["model"]
        spec = self.registry.find(model)
        if not identity.may_use(model) and not (spec and identity.may_use(spec.name)):
            raise ModelNotFound(f"The model `{model}` does not exist or you do not have "
                                "access to it.", param="model")
        if self.limiter is None or not identity.key_id:
            return FREE
        try:
            tenant = (await self.tenants.get(identity.tenant) if self.tenants is not None
                      else TenantPolicy(identity.tenant))
        except TransientBrokerError as exc:  # Redis down and the policy not cached
            raise PipelineUnavailable("Limits cannot be checked now (Redis does not "
                                      "answer); try again later.") from exc
        tokens = estimate_tokens(generation, self.registry)
        try:
            admission = await self.limiter.admit(identity, tenant, request_id, tokens,
                                                 deadline_ms)
        except (RateLimited, QuotaExceeded) as exc:
            self._audit_rejection(identity, exc, request_id, model)
            raise
        return Ticket(self, admission, tokens)

    def _audit_rejection(self, identity: Identity, exc: RateLimited | QuotaExceeded,
                         request_id: str, model: str) -> None:
        """One audit event a second per key and kind; the ones held back are
        counted in the next (a client hammering past its limit cannot flood
        ``conveyor.audit``)."""
        if self.audit is None:
            return
        action = "quota.rejected" if isinstance(exc, QuotaExceeded) else "limit.rejected"
        now = time.monotonic()
        last, held = self._rejections.get((identity.key_id, action), (0.0, 0))
        if now - last < _AUDIT_EVERY_S:
            self._rejections[(identity.key_id, action)] = (last, held + 1)
            return
        if len(self._rejections) >= _AUDIT_MEMORY:
            self._rejections.clear()
        self._rejections[(identity.key_id, action)] = (now, 0)
        detail = {"model": model, **({"held_back": str(held)} if held else {})}
        self.audit.record(action, tenant=identity.tenant, key_id=identity.key_id,
                          actor=self.actor, reason=exc.message, request_id=request_id,
                          detail=detail)

    def settle_later(self, admission: Any, used: int) -> None:
        """Settle in the background: it is asked for when a response ends, often
        from a response that is being cancelled (the client left)."""
        assert self.limiter is not None
        task = asyncio.create_task(self.limiter.settle(admission, used))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def drain(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

"""Who is asking: the ``Authorization`` header turned into an :class:`Identity`,
as ``CONVEYOR_AUTH`` says: ``none`` (the ``default`` tenant), ``keys`` or ``jwt``.
A bad credential is a 401 ``invalid_api_key``, audited by the first hex digits
of its keyed hash (once per ten seconds per credential); Redis unreachable is
a 503 for a key not cached."""

from __future__ import annotations

import hashlib
import hmac
import time

from conveyor.errors import InvalidApiKey, PipelineUnavailable, TransientBrokerError
from conveyor.settings import Settings
from gateway.audit import Audit
from gateway.auth.jwt_tokens import JwtVerifier
from gateway.auth.keys import KeyStore
from gateway.auth.types import ANONYMOUS_TENANT, Identity, KeyRecord

__all__ = ["ANONYMOUS", "Authenticator"]

_AUDIT_EVERY_S = 10.0

ANONYMOUS = Identity(tenant=ANONYMOUS_TENANT, key_id="")


class Authenticator:
    def __init__(self, settings: Settings, *, keys: KeyStore | None = None,
                 tokens: JwtVerifier | None = None, audit: Audit | None = None,
                 actor: str = "") -> None:
        self.mode = settings.auth.mode
        if self.mode == "keys" and keys is None:
            raise ValueError("CONVEYOR_AUTH=keys needs a key store")
        if self.mode == "jwt" and tokens is None:
            raise ValueError("CONVEYOR_AUTH=jwt needs a token verifier")
        self.keys = keys
        self.tokens = tokens
        self.audit = audit
        self.actor = actor
        self._secret = settings.auth.secret.get_secret_value().encode()

    async def identify(self, authorization: str | None) -> Identity:
        if self.mode == "none":
            return ANONYMOUS
        credential = _bearer(authorization)
        if credential is None:
            self._failed("", "missing", "The request carries no API key: send "
                         "'Authorization: Bearer <key>'.")
        assert credential is not None
        if self.mode == "jwt":
            assert self.tokens is not None
            try:
                return self.tokens.verify(credential)
            except InvalidApiKey as exc:
                self._failed(credential, getattr(exc, "reason", "invalid_token"), exc.message)
        assert self.keys is not None
        try:
            record = await self.keys.lookup(credential)
        except TransientBrokerError as exc:
            raise PipelineUnavailable("Keys cannot be checked now (Redis does not answer); "
                                      "try again later.") from exc
        now_ms = int(time.time() * 1000)
        if record is None:
            self._failed(credential, "unknown", "Incorrect API key provided.")
        assert record is not None
        if record.revoked_ms:
            self._failed(credential, "revoked", "This API key has been revoked.",
                         record)
        if not record.usable(now_ms):
            self._failed(credential, "expired", "This API key has expired.", record)
        await self.keys.touch(record)
        return Identity(tenant=record.tenant, key_id=record.id, limits=record.limits,
                        models=frozenset(record.models) if record.models else None)

    def hash_prefix(self, credential: str) -> str:
        """The first 12 hex digits of the credential's keyed hash: enough to tell
        a key in an audit trail, useless to recover it."""
        if not credential:
            return ""
        return hmac.new(self._secret, credential.encode(), hashlib.sha256).hexdigest()[:12]

    def _failed(self, credential: str, reason: str, message: str,
                record: KeyRecord | None = None) -> None:
        self._audit_failure(credential, reason, record)
        error = InvalidApiKey(message)
        error.headers["WWW-Authenticate"] = "Bearer"
        raise error

    def _audit_failure(self, credential: str, reason: str, record: KeyRecord | None) -> None:
        if self.audit is None:
            return
        prefix = self.hash_prefix(credential)
        self.audit.record_throttled(f"auth:{prefix}{reason}", _AUDIT_EVERY_S, "auth.failed",
                                    tenant=record.tenant if record else "",
                                    key_id=record.id if record else "",
                                    hash_prefix="" if record else prefix, actor=self.actor,
                                    reason=reason)


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()

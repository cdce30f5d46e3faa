"""API key secrets and ids. A secret is ``cvy-`` + 40 url-safe random characters,
shown once; only its ``HMAC-SHA-256(auth_secret, secret)`` is kept (why:
docs/decisions/0026-keys-and-limits-in-redis.md), and an empty ``auth_secret``
is refused (:class:`AuthSecretMissing`). A key id (``key_`` + 16 hex) is public."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from conveyor.errors import ConveyorError
from conveyor.settings import AuthSettings

__all__ = ["SECRET_PREFIX", "AuthSecretMissing", "new_secret", "new_key_id", "hash_secret"]

SECRET_PREFIX = "cvy-"
_SECRET_BYTES = 30  # token_urlsafe(30) is 40 characters


class AuthSecretMissing(ConveyorError):
    """``auth_secret`` is empty: no key can be hashed, so none can be made or checked."""


def new_secret() -> str:
    """A fresh secret: ``cvy-`` + 40 url-safe characters."""
    return SECRET_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)


def new_key_id() -> str:
    """A fresh public key id: ``key_`` + 16 hex digits."""
    return "key_" + secrets.token_hex(8)


def hash_secret(auth: AuthSettings, secret: str) -> str:
    """The hex HMAC-SHA-256 of ``secret`` under the server secret."""
    server = auth.secret.get_secret_value()
    if not server:
        raise AuthSecretMissing(
            "auth_secret is empty: set CONVEYOR_AUTH_SECRET (a long random string, the "
            "same on every gateway and wherever `conveyor keys` runs) to hash API keys")
    return hmac.new(server.encode(), secret.encode(), hashlib.sha256).hexdigest()

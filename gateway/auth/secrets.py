"""API key secrets and ids: how they are made, and the only form a secret is kept in.

A secret is ``cvy-`` + 40 url-safe random characters (240 bits from
:func:`secrets.token_urlsafe`), shown to its owner once and never stored.
Conveyor keeps only ``hex(HMAC-SHA-256(auth_secret, secret))``: a copy of
Redis or of the ``keys`` topic is useless without the server secret, and a
lookup is one hash and one index read (no slow password hash is needed, the
secret has far more entropy than any password). A key id (``key_`` + 16 hex)
is public: it names a key in lists, logs and audit events.

An empty ``auth_secret`` would make the hash a plain keyed-by-nothing digest,
so every operation that hashes refuses it with :class:`AuthSecretMissing`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from conveyor.errors import ConveyorError
from conveyor.settings import AuthSettings

__all__ = ["SECRET_PREFIX", "AuthSecretMissing", "new_secret", "new_key_id", "hash_secret",
           "hash_prefix"]

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


def hash_prefix(key_hash: str) -> str:
    """What an audit event may say of an unknown key: the first 12 hex digits."""
    return key_hash[:12]

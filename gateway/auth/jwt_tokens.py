"""Signed bearer tokens (``CONVEYOR_AUTH=jwt``): a JWT in, an :class:`Identity` out
(claims and rules: docs/operating/keys-and-limits.md). The key decides the
algorithm, never the header: HS256 with ``CONVEYOR_JWT_SECRET`` (32 bytes or
more), RS256/ES256 with an RSA (2048+ bits) or P-256 key of the JWKS file by
``kid``; nothing else, and no key a token names is fetched. The JWKS file is
re-read when it changes (the last good set stays). A failure is an
:class:`InvalidJwt` (401) never echoing the token; a verified token is cached
until it expires or 30 s. For one event loop."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from conveyor.errors import InvalidApiKey
from conveyor.settings import Settings
from gateway.auth.types import Identity, Limits

__all__ = ["JwtFailure", "InvalidJwt", "JwtVerifier"]

log = logging.getLogger(__name__)

JwtFailure = Literal[
    "malformed",  # not a JWT, or a claim of the wrong type
    "bad_signature",
    "expired",
    "not_yet_valid",  # nbf or iat in the future
    "no_exp",
    "no_sub",
    "no_tenant",
    "bad_tenant",  # the tenant claim is not a valid tenant name
    "wrong_audience",
    "wrong_issuer",
    "unknown_kid",
    "unsupported_alg",  # none, or an algorithm without a configured key
    "alg_mismatch",  # the header's alg is not the one its key verifies
]

CACHE_TTL_S = 30.0
CACHE_ENTRIES = 10_000
JWKS_CHECK_INTERVAL_S = 1.0
MAX_TOKEN_CHARS = 16_384
MAX_MODELS = 1_024
MIN_HMAC_SECRET_BYTES = 32
MIN_RSA_BITS = 2_048
_MAX_LIMIT = 2**53
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ASYMMETRIC = ("RS256", "ES256")


# what PyJWT's errors are called here, the first that matches
_DECODE_ERRORS: tuple[tuple[type[jwt.PyJWTError], JwtFailure, str], ...] = (
    (jwt.InvalidSignatureError, "bad_signature", "JWT signature does not verify"),
    (jwt.ExpiredSignatureError, "expired", "JWT has expired"),
    (jwt.ImmatureSignatureError, "not_yet_valid", "JWT is not valid yet"),
    (jwt.InvalidAudienceError, "wrong_audience", "JWT audience is not accepted"),
    (jwt.InvalidIssuerError, "wrong_issuer", "JWT issuer is not accepted"),
    (jwt.InvalidAlgorithmError, "alg_mismatch", "JWT algorithm does not match its key"),
    (jwt.PyJWTError, "malformed", "JWT is malformed"),
)
_MISSING: dict[str, JwtFailure] = {"exp": "no_exp", "sub": "no_sub", "aud": "wrong_audience",
                                   "iss": "wrong_issuer"}


class InvalidJwt(InvalidApiKey):
    """A bearer token that does not verify; ``reason`` is for the audit trail."""

    def __init__(self, reason: JwtFailure, message: str) -> None:
        super().__init__(message)
        self.reason: JwtFailure = reason


@dataclass(frozen=True)
class _Key:
    kid: str | None
    alg: Literal["RS256", "ES256"]
    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey


@dataclass(frozen=True)
class _KeySet:
    by_kid: dict[str, _Key]
    only: _Key | None  # the set's key when it holds exactly one
    count: int


def _load_jwks(path: Path) -> _KeySet:
    """The usable verification keys of a JWKS file; ValueError when there are none."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the JWKS file {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ValueError(f"the JWKS file {path} is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError(f"the JWKS file {path} has no \"keys\" list")
    try:
        jwks = jwt.PyJWKSet.from_dict(data)
    except (jwt.PyJWTError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"the JWKS file {path} holds no usable key: {exc}") from None
    keys: list[_Key] = []
    for jwk in jwks.keys:
        kid = jwk.key_id
        if jwk.public_key_use not in (None, "sig"):
            continue
        key: Any = jwk.key
        if isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
            log.warning("JWKS file %s: key %r is a private key; only its public half is used",
                        path, kid)
            key = key.public_key()
        if jwk.algorithm_name == "RS256" and isinstance(key, rsa.RSAPublicKey):
            if key.key_size < MIN_RSA_BITS:
                log.warning("JWKS file %s: RSA key %r has %d bits, fewer than %d: skipped",
                            path, kid, key.key_size, MIN_RSA_BITS)
                continue
            keys.append(_Key(kid, "RS256", key))
        elif (jwk.algorithm_name == "ES256" and isinstance(key, ec.EllipticCurvePublicKey)
              and isinstance(key.curve, ec.SECP256R1)):
            keys.append(_Key(kid, "ES256", key))
        else:
            log.warning("JWKS file %s: key %r (%s) is neither RS256 nor ES256: skipped",
                        path, kid, jwk.algorithm_name)
    if not keys:
        raise ValueError(f"the JWKS file {path} holds no RS256 (RSA) or ES256 (P-256) key")
    by_kid: dict[str, _Key] = {}
    for k in keys:
        if k.kid is None:
            if len(keys) > 1:
                log.warning("JWKS file %s: a key without kid among %d keys is never used",
                            path, len(keys))
        elif k.kid in by_kid:
            log.warning("JWKS file %s: kid %r appears twice; the first key is used", path, k.kid)
        else:
            by_kid[k.kid] = k
    return _KeySet(by_kid=by_kid, only=keys[0] if len(keys) == 1 else None, count=len(keys))


def _file_stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _limit(claims: dict[str, Any], name: str) -> int | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _MAX_LIMIT:
        raise InvalidJwt("malformed", f"JWT claim {name!r} must be a positive integer")
    return value


def _models(claims: dict[str, Any]) -> frozenset[str] | None:
    value = claims.get("models")
    if value is None:
        return None
    if (not isinstance(value, list) or not value or len(value) > MAX_MODELS
            or not all(isinstance(m, str) and 0 < len(m) <= 256 for m in value)):
        raise InvalidJwt("malformed", "JWT claim 'models' must be a non-empty list of model names")
    return frozenset(value)


class JwtVerifier:
    """Verifies bearer tokens against the settings' secret and JWKS file (see the module)."""

    def __init__(self, settings: Settings) -> None:
        secret = settings.auth.jwt_secret.get_secret_value().encode()
        if not secret and settings.auth.jwt_jwks_file is None:
            raise ValueError("CONVEYOR_AUTH=jwt needs CONVEYOR_JWT_SECRET (HS256) or "
                             "CONVEYOR_JWT_JWKS_FILE (RS256/ES256); neither is set")
        if secret and len(secret) < MIN_HMAC_SECRET_BYTES:
            raise ValueError(f"CONVEYOR_JWT_SECRET must be at least {MIN_HMAC_SECRET_BYTES} "
                             "bytes for HS256")
        if not settings.auth.jwt_tenant_claim:
            raise ValueError("CONVEYOR_JWT_TENANT_CLAIM must name a claim")
        if settings.auth.jwt_leeway_s < 0:
            raise ValueError("CONVEYOR_JWT_LEEWAY_S must not be negative")
        self._secret = secret
        self._audience = settings.auth.jwt_audience or None
        self._issuer = settings.auth.jwt_issuer or None
        self._tenant_claim = settings.auth.jwt_tenant_claim
        self._leeway_s = settings.auth.jwt_leeway_s
        self._required = ["exp", "sub", *(["aud"] if self._audience else []),
                          *(["iss"] if self._issuer else [])]
        self._jwks_file = settings.auth.jwt_jwks_file
        self._keys: _KeySet | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at = time.monotonic()
        self._reload_error: str | None = None
        if self._jwks_file is not None:
            try:
                self._stamp = _file_stamp(self._jwks_file)
                self._keys = _load_jwks(self._jwks_file)
            except OSError as exc:
                raise ValueError(f"CONVEYOR_JWT_JWKS_FILE: cannot read {self._jwks_file}: "
                                 f"{exc.strerror or exc}") from None
            except ValueError as exc:
                raise ValueError(f"CONVEYOR_JWT_JWKS_FILE: {exc}") from None
        # token -> (identity, wall-clock deadline); insertion order is age
        self._cache: dict[str, tuple[Identity, float]] = {}

    def verify(self, token: str) -> Identity:
        """The identity a bearer token (without its ``Bearer`` prefix) carries; else InvalidJwt."""
        self._refresh_jwks()
        now = time.time()
        hit = self._cache.get(token)
        if hit is not None:
            if now < hit[1]:
                return hit[0]
            del self._cache[token]
        claims = self._decode(token)
        identity = self._identity(claims)
        deadline = min(int(claims["exp"]) + self._leeway_s, now + CACHE_TTL_S)
        if deadline > now:
            if len(self._cache) >= CACHE_ENTRIES:
                del self._cache[next(iter(self._cache))]
            self._cache[token] = (identity, deadline)
        return identity

    def _refresh_jwks(self) -> None:
        """Re-read the JWKS file when it changed, at most once a second."""
        if self._jwks_file is None:
            return
        mono = time.monotonic()
        if mono - self._checked_at < JWKS_CHECK_INTERVAL_S:
            return
        self._checked_at = mono
        try:
            stamp = _file_stamp(self._jwks_file)
            if stamp == self._stamp:
                return
            keys = _load_jwks(self._jwks_file)
        except (OSError, ValueError) as exc:
            error = str(exc)
            if error != self._reload_error:
                log.error("JWKS file %s: %s; the previous keys stay in force",
                          self._jwks_file, error)
                self._reload_error = error
            return
        self._keys, self._stamp, self._reload_error = keys, stamp, None
        self._cache.clear()
        log.info("JWKS file %s re-read: %d keys", self._jwks_file, keys.count)

    def _key_for(self, header: dict[str, Any]) -> tuple[Any, str]:
        """The key and the one algorithm it verifies, chosen by the header's alg and kid."""
        alg = header.get("alg")
        if alg == "HS256" and self._secret:
            return self._secret, "HS256"
        if alg not in _ASYMMETRIC or self._keys is None:
            raise InvalidJwt("unsupported_alg", "JWT algorithm is not accepted")
        kid = header.get("kid")
        if kid is None:
            key = self._keys.only
            if key is None:
                raise InvalidJwt("unknown_kid", "JWT has no kid and the JWKS holds several keys")
        else:
            key = self._keys.by_kid.get(kid)
            if key is None:
                raise InvalidJwt("unknown_kid", "JWT kid matches no key in the JWKS")
        if alg != key.alg:
            raise InvalidJwt("alg_mismatch", "JWT algorithm does not match its key")
        return key.key, key.alg

    def _decode(self, token: str) -> dict[str, Any]:
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
            raise InvalidJwt("malformed", "JWT is malformed")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise InvalidJwt("malformed", "JWT is malformed") from None
        if not isinstance(header.get("alg"), str):
            raise InvalidJwt("malformed", "JWT header names no algorithm")
        key, alg = self._key_for(header)
        try:
            return jwt.decode(
                token, key, algorithms=[alg], audience=self._audience, issuer=self._issuer,
                leeway=self._leeway_s,
                options={"require": self._required, "verify_aud": self._audience is not None,
                         "enforce_minimum_key_length": True},
            )
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidJwt(_MISSING.get(exc.claim, "malformed"),
                             f"JWT has no {exc.claim} claim") from None
        except jwt.PyJWTError as exc:
            raise next(InvalidJwt(reason, message) for kind, reason, message in _DECODE_ERRORS
                       if isinstance(exc, kind)) from None

    def _identity(self, claims: dict[str, Any]) -> Identity:
        sub = claims["sub"]
        if not isinstance(sub, str) or not sub:
            raise InvalidJwt("no_sub", "JWT has no sub claim")
        if len(sub) > 256 or not sub.isprintable():
            raise InvalidJwt("malformed", "JWT claim 'sub' must be 1 to 256 printable characters")
        tenant = claims.get(self._tenant_claim)
        if tenant is None or tenant == "":
            raise InvalidJwt("no_tenant", f"JWT has no {self._tenant_claim!r} claim (the tenant)")
        if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
            raise InvalidJwt("bad_tenant", f"JWT claim {self._tenant_claim!r} must be 1 to 64 "
                                      "characters of A-Z a-z 0-9 . _ -")
        limits = Limits(rpm=_limit(claims, "rpm"), tpm=_limit(claims, "tpm"),
                        concurrency=_limit(claims, "concurrency"))
        return Identity(tenant=tenant, key_id=f"jwt:{sub}", limits=limits,
                        models=_models(claims))

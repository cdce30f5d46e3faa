"""JWT bearer tokens: real keys (RSA 2048, EC P-256), a real JWKS file, tokens signed by PyJWT."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from pydantic import SecretStr

from conveyor.errors import InvalidApiKey
from conveyor.settings import load_settings
from gateway.auth.jwt_tokens import CACHE_ENTRIES, InvalidJwt, JwtVerifier
from gateway.auth.types import Identity, Limits

SECRET = "s" * 40
PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def jwk(kid: str | None, key: PrivateKey) -> dict[str, Any]:
    public = key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        data = jwt.algorithms.RSAAlgorithm.to_jwk(public, as_dict=True)
    else:
        data = jwt.algorithms.ECAlgorithm.to_jwk(public, as_dict=True)
    if kid is not None:
        data["kid"] = kid
    return data


def write_jwks(path: Path, *keys: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"keys": list(keys)}))
    return path


def claims(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"sub": "svc-1", "tenant": "acme", "exp": int(time.time()) + 300}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def sign(payload: dict[str, Any], key: Any = SECRET, alg: str = "HS256",
         kid: str | None = None) -> str:
    return jwt.encode(payload, key, algorithm=alg, headers={"kid": kid} if kid else None)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_signed_hs256(payload: dict[str, Any], secret: bytes, kid: str | None = None) -> str:
    """An HS256 token PyJWT would refuse to make (it will not take a PEM as a secret)."""
    header: dict[str, Any] = {"alg": "HS256", "typ": "JWT", **({"kid": kid} if kid else {})}
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(mac)}"


def hs_verifier(**settings: Any) -> JwtVerifier:
    return JwtVerifier(load_settings(auth="jwt", jwt_secret=SecretStr(SECRET), **settings))


def jwks_verifier(path: Path, **settings: Any) -> JwtVerifier:
    return JwtVerifier(load_settings(auth="jwt", jwt_jwks_file=path, **settings))


@pytest.fixture
def jwks(tmp_path: Path, rsa_key: rsa.RSAPrivateKey,
         ec_key: ec.EllipticCurvePrivateKey) -> Path:
    return write_jwks(tmp_path / "jwks.json", jwk("r1", rsa_key), jwk("e1", ec_key))


def rejects(verifier: JwtVerifier, token: str, reason: str) -> InvalidJwt:
    with pytest.raises(InvalidJwt) as caught:
        verifier.verify(token)
    assert caught.value.reason == reason, caught.value.message
    return caught.value


# -- tokens that verify ----------------------------------------------------------------------


def test_hs256_gives_the_identity_with_narrowed_limits_and_models() -> None:
    token = sign(claims(rpm=60, tpm=10_000, concurrency=4, models=["llama", "qwen"]))
    identity = hs_verifier().verify(token)
    assert identity == Identity(tenant="acme", key_id="jwt:svc-1",
                                limits=Limits(rpm=60, tpm=10_000, concurrency=4),
                                models=frozenset({"llama", "qwen"}))
    assert identity.may_use("llama") and not identity.may_use("other")


def test_without_optional_claims_the_token_has_no_limits_and_every_model() -> None:
    identity = hs_verifier().verify(sign(claims(rpm=None, tpm=None)))
    assert identity.limits.unlimited and identity.models is None
    # JSON null reads as absent
    assert hs_verifier().verify(sign(claims(rpm=None) | {"tpm": None})).limits.unlimited


@pytest.mark.parametrize(("kid", "alg"), [("r1", "RS256"), ("e1", "ES256")])
def test_rs256_and_es256_verify_with_the_jwks_key_of_their_kid(
        jwks: Path, rsa_key: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey,
        kid: str, alg: str) -> None:
    key = rsa_key if alg == "RS256" else ec_key
    token = sign(claims(tenant="t.2_x-y", sub="user@example", rpm=5, models=["m"]),
                 key, alg, kid)
    identity = jwks_verifier(jwks).verify(token)
    assert identity == Identity(tenant="t.2_x-y", key_id="jwt:user@example",
                                limits=Limits(rpm=5), models=frozenset({"m"}))


def test_a_jwks_of_one_key_verifies_tokens_without_kid(
        tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    path = write_jwks(tmp_path / "one.json", jwk(None, ec_key))
    assert jwks_verifier(path).verify(sign(claims(), ec_key, "ES256")).tenant == "acme"


def test_secret_and_jwks_together_each_verify_their_own(
        jwks: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    verifier = hs_verifier(jwt_jwks_file=jwks)
    assert verifier.verify(sign(claims())).tenant == "acme"
    assert verifier.verify(sign(claims(), rsa_key, "RS256", "r1")).tenant == "acme"


def test_a_custom_tenant_claim_is_read() -> None:
    token = sign(claims(tenant=None, org="globex"))
    assert hs_verifier(jwt_tenant_claim="org").verify(token).tenant == "globex"


def test_exp_within_the_leeway_is_accepted() -> None:
    token = sign(claims(exp=int(time.time()) - 2))
    assert hs_verifier(jwt_leeway_s=5.0).verify(token).tenant == "acme"
    rejects(hs_verifier(jwt_leeway_s=0.0), token, "expired")


# -- tokens that do not ----------------------------------------------------------------------


def test_wrong_signature(jwks: Path) -> None:
    rejects(hs_verifier(), sign(claims(), "x" * 40), "bad_signature")
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rejects(jwks_verifier(jwks), sign(claims(), other, "RS256", "r1"), "bad_signature")
    tampered = sign(claims(tenant="acme"))
    head, _, sig = tampered.split(".")
    forged = b64(json.dumps(claims(tenant="victim")).encode())
    rejects(hs_verifier(), f"{head}.{forged}.{sig}", "bad_signature")


def test_expired() -> None:
    rejects(hs_verifier(jwt_leeway_s=0.0), sign(claims(exp=int(time.time()) - 10)), "expired")


def test_not_before_or_issued_at_in_the_future() -> None:
    later = int(time.time()) + 120
    rejects(hs_verifier(), sign(claims(nbf=later)), "not_yet_valid")
    rejects(hs_verifier(), sign(claims(iat=later)), "not_yet_valid")


def test_missing_required_claims() -> None:
    rejects(hs_verifier(), sign(claims(tenant=None)), "no_tenant")
    rejects(hs_verifier(), sign(claims(tenant="")), "no_tenant")
    rejects(hs_verifier(), sign(claims(sub=None)), "no_sub")
    rejects(hs_verifier(), sign(claims(sub="")), "no_sub")
    rejects(hs_verifier(), sign(claims(exp=None)), "no_exp")
    rejects(hs_verifier(jwt_tenant_claim="org"), sign(claims()), "no_tenant")


@pytest.mark.parametrize("tenant", ["a" * 65, "ac me", "acme/../x", "ümlaut", 42, ["acme"]])
def test_a_tenant_outside_the_allowed_names(tenant: Any) -> None:
    rejects(hs_verifier(), sign(claims(tenant=tenant)), "bad_tenant")


def test_audience_and_issuer_when_configured() -> None:
    verifier = hs_verifier(jwt_audience="conveyor", jwt_issuer="https://idp.example")
    good = claims(aud="conveyor", iss="https://idp.example")
    assert verifier.verify(sign(good)).tenant == "acme"
    assert verifier.verify(sign(good | {"aud": ["other", "conveyor"]})).tenant == "acme"
    rejects(verifier, sign(good | {"aud": "other"}), "wrong_audience")
    rejects(verifier, sign(claims(iss="https://idp.example")), "wrong_audience")
    rejects(verifier, sign(good | {"iss": "https://evil.example"}), "wrong_issuer")
    rejects(verifier, sign(claims(aud="conveyor")), "wrong_issuer")


def test_audience_and_issuer_are_ignored_when_not_configured() -> None:
    assert hs_verifier().verify(sign(claims(aud="any", iss="any"))).tenant == "acme"


def test_unknown_kid(jwks: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    rejects(jwks_verifier(jwks), sign(claims(), rsa_key, "RS256", "nope"), "unknown_kid")
    # several keys and no kid: no key is guessed
    rejects(jwks_verifier(jwks), sign(claims(), rsa_key, "RS256"), "unknown_kid")


def test_alg_none_is_refused(jwks: Path) -> None:
    token = jwt.encode(claims(), "", algorithm="none")
    rejects(hs_verifier(), token, "unsupported_alg")
    rejects(jwks_verifier(jwks), token, "unsupported_alg")
    rejects(jwks_verifier(jwks), jwt.encode(claims(), "", algorithm="none",
                                            headers={"kid": "r1"}), "unsupported_alg")


def test_hs256_signed_with_the_rsa_public_pem_is_refused(
        jwks: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    pem = rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    for kid in (None, "r1"):
        token = hand_signed_hs256(claims(), pem, kid)
        rejects(jwks_verifier(jwks), token, "unsupported_alg")
        # with a secret configured too, the token meets the secret and nothing else
        rejects(hs_verifier(jwt_jwks_file=jwks), token, "bad_signature")


def test_a_symmetric_key_in_the_jwks_never_verifies(
        tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    oct_key = {"kty": "oct", "kid": "h1", "k": b64(SECRET.encode())}
    path = write_jwks(tmp_path / "mixed.json", oct_key, jwk("r1", rsa_key))
    rejects(jwks_verifier(path), sign(claims(), SECRET, "HS256", "h1"), "unsupported_alg")


def test_the_header_alg_must_be_the_one_its_key_verifies(
        jwks: Path, rsa_key: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey) -> None:
    rejects(jwks_verifier(jwks), sign(claims(), ec_key, "ES256", "r1"), "alg_mismatch")
    rejects(jwks_verifier(jwks), sign(claims(), rsa_key, "RS256", "e1"), "alg_mismatch")
    rejects(jwks_verifier(jwks), sign(claims(), rsa_key, "RS512", "r1"), "unsupported_alg")


@pytest.mark.parametrize("token", [
    "", "abc", "a.b.c", "a.b", "x" * 20_000, "....",
    f"{b64(b'[1]')}.{b64(b'{}')}.c2ln",  # a header that is not an object
    f"{b64(b'{}')}.{b64(b'{}')}.c2ln",  # a header without alg
])
def test_a_malformed_token_string(token: str) -> None:
    rejects(hs_verifier(), token, "malformed")


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b"\xff\xfe"])
def test_a_signed_payload_that_is_not_a_json_object_is_malformed(body: bytes) -> None:
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64(body)
    mac = hmac.new(SECRET.encode(), f"{header}.{payload}".encode(), hashlib.sha256).digest()
    rejects(hs_verifier(), f"{header}.{payload}.{b64(mac)}", "malformed")


@pytest.mark.parametrize("bad", [
    {"rpm": "60"}, {"rpm": 0}, {"tpm": -5}, {"concurrency": True}, {"rpm": 1.5},
    {"tpm": 2**60}, {"models": "llama"}, {"models": [1]}, {"models": []}, {"models": [""]},
    {"sub": 123}, {"sub": "a\nb"}, {"exp": "soon"}, {"nbf": "later"}, {"iat": "then"},
])
def test_claims_of_the_wrong_type_are_malformed(bad: dict[str, Any]) -> None:
    rejects(hs_verifier(), sign(claims(**bad)), "malformed")


# -- the error itself ------------------------------------------------------------------------


def test_failures_are_401_invalid_api_key() -> None:
    error = rejects(hs_verifier(), sign(claims(), "x" * 40), "bad_signature")
    assert isinstance(error, InvalidApiKey)
    assert error.status == 401 and error.code == "invalid_api_key"
    assert error.envelope()["error"]["code"] == "invalid_api_key"


def test_error_messages_never_contain_the_token_or_its_parts(
        jwks: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    cases: list[tuple[JwtVerifier, str]] = [
        (hs_verifier(), sign(claims(), "x" * 40)),
        (hs_verifier(jwt_leeway_s=0.0), sign(claims(exp=int(time.time()) - 10))),
        (hs_verifier(), sign(claims(tenant="bad tenant!"))),
        (hs_verifier(), sign(claims(rpm="lots"))),
        (hs_verifier(jwt_audience="conveyor"), sign(claims(aud="elsewhere"))),
        (jwks_verifier(jwks), sign(claims(), rsa_key, "RS256", "secret-kid-value")),
        (hs_verifier(), "not.a-jwt.token-with-secret-stuff"),
    ]
    for verifier, token in cases:
        with pytest.raises(InvalidJwt) as caught:
            verifier.verify(token)
        shown = " ".join([str(caught.value), caught.value.message, repr(caught.value),
                          json.dumps(caught.value.envelope())])
        for part in [token, *token.split(".")]:
            assert len(part) < 4 or part not in shown, (caught.value.reason, shown)
        assert "secret-kid-value" not in shown and "bad tenant!" not in shown


# -- startup ---------------------------------------------------------------------------------


def test_neither_secret_nor_jwks_is_a_startup_error() -> None:
    with pytest.raises(ValueError, match="CONVEYOR_JWT_SECRET.*CONVEYOR_JWT_JWKS_FILE"):
        JwtVerifier(load_settings(auth="jwt"))


def test_a_short_secret_is_a_startup_error() -> None:
    with pytest.raises(ValueError, match="CONVEYOR_JWT_SECRET"):
        JwtVerifier(load_settings(auth="jwt", jwt_secret=SecretStr("short")))


def test_an_unusable_jwks_file_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CONVEYOR_JWT_JWKS_FILE"):
        jwks_verifier(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        jwks_verifier(tmp_path / "bad.json")
    oct_only = write_jwks(tmp_path / "oct.json", {"kty": "oct", "k": b64(SECRET.encode())})
    with pytest.raises(ValueError, match="no RS256"):
        jwks_verifier(oct_only)
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(ValueError, match="no RS256"):
        jwks_verifier(write_jwks(tmp_path / "weak.json", jwk("w", weak)))


# -- JWKS rotation and the cache -------------------------------------------------------------


def test_jwks_rotation_is_picked_up_without_restart(
        tmp_path: Path, rsa_key: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey) -> None:
    path = write_jwks(tmp_path / "jwks.json", jwk("old", rsa_key))
    verifier = jwks_verifier(path)
    old_token = sign(claims(), rsa_key, "RS256", "old")
    new_token = sign(claims(tenant="rotated"), ec_key, "ES256", "new")
    assert verifier.verify(old_token).tenant == "acme"  # now cached
    rejects(verifier, new_token, "unknown_kid")

    write_jwks(path, jwk("new", ec_key))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    rejects(verifier, new_token, "unknown_kid")  # checked at most once a second
    time.sleep(1.05)
    assert verifier.verify(new_token).tenant == "rotated"
    rejects(verifier, old_token, "unknown_kid")  # the cache went with the old keys

    # a broken rewrite keeps the last good keys in force
    path.write_text("{half a file")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    time.sleep(1.05)
    assert verifier.verify(sign(claims(tenant="still"), ec_key, "ES256", "new")).tenant == "still"


def test_a_verified_token_is_served_from_the_cache_until_it_expires() -> None:
    verifier = hs_verifier(jwt_leeway_s=0.0)
    token = sign(claims())
    first = verifier.verify(token)
    assert verifier.verify(token) is first

    exp = int(time.time()) + 1
    short = sign(claims(exp=exp))
    assert verifier.verify(short).tenant == "acme"
    time.sleep(max(0.0, exp - time.time()) + 0.05)
    rejects(verifier, short, "expired")


def test_the_cache_is_bounded_and_drops_the_oldest() -> None:
    verifier = hs_verifier()
    tokens = [sign(claims(sub=f"s{i}")) for i in range(CACHE_ENTRIES + 1)]
    identities = [verifier.verify(t) for t in tokens]
    assert verifier.verify(tokens[-1]) is identities[-1]
    assert verifier.verify(tokens[1]) is identities[1]
    again = verifier.verify(tokens[0])  # dropped when the last one came in: verified afresh
    assert again == identities[0] and again is not identities[0]

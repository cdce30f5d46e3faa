"""Keys, JWTs and limits over gateway replicas: the Conveyor that
tests/pipeline/test_auth.py shares among its tests, and what they ask it with.
Every secret handed out is kept in :data:`SECRETS_SEEN`, so a test can look for
each one where none may be (topics, logs, Redis values)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jwt

from tests.support.pipeline import Pipeline

SECRET = "conveyor-test-server-secret-" + uuid.uuid4().hex
JWT_SECRET = "conveyor-test-jwt-secret-" + uuid.uuid4().hex
ADMIN_TOKEN = "conveyor-test-admin-" + uuid.uuid4().hex
SECRETS_SEEN: list[str] = []


class Replicas:
    def __init__(self, p: Pipeline, second: str, jwt_url: str) -> None:
        self.p = p
        self.urls = [p.base_url, second]
        self.jwt_url = jwt_url

    def key(self, *args: str, tenant: str | None = None) -> tuple[str, str]:
        """A new key (id, secret) of a tenant of its own unless one is named."""
        tenant = tenant or f"t{uuid.uuid4().hex[:8]}"
        out = self.p.cli("keys", "create", "--tenant", tenant, "--name", "test", *args)
        secret = out.strip().splitlines()[-1]
        assert secret.startswith("cvy-") and " " not in secret
        found = re.search(r"key_[0-9a-f]{16}", out)
        assert found is not None, out
        SECRETS_SEEN.append(secret)
        return found.group(0), secret


def start_replicas(logs: Path) -> Replicas:
    """A Conveyor with keys (an ``ops`` key for its own client), an accounting
    app, a second gateway replica and a third gateway that takes JWTs; the
    caller closes ``replicas.p``."""
    p = Pipeline(logs, CONVEYOR_AUTH="keys",
                 CONVEYOR_AUTH_SECRET=SECRET, CONVEYOR_ADMIN_TOKEN=ADMIN_TOKEN)
    try:
        p.cli("topics")
        _, p.api_key = Replicas(p, "", "").key(tenant="ops")
        p.start(workers=1, contexts=2)
        p.spawn("accounting", "accounting")
        second = p.start_gateway("gateway2")
        jwt_url = p.start_gateway("gateway-jwt", CONVEYOR_AUTH="jwt",
                                  CONVEYOR_JWT_SECRET=JWT_SECRET)
    except BaseException:
        p.close()
        raise
    return Replicas(p, second, jwt_url)


def body(max_tokens: int = 1, stream: bool = False) -> dict[str, Any]:
    return {"model": "smollm2", "prompt": "Hello", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


async def burst(urls: list[str], secret: str, n: int, max_tokens: int = 1,
                spread_s: float = 0.0, stream: bool = False) -> list[httpx.Response]:
    """``n`` requests over the replicas in turn, all at once or spread over ``spread_s``."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(spread_s * i / n)
            return await client.post(f"{urls[i % len(urls)]}/v1/completions",
                                     json=body(max_tokens, stream),
                                     headers={"Authorization": f"Bearer {secret}"})
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def statuses(responses: list[httpx.Response]) -> Counter[int]:
    return Counter(r.status_code for r in responses)


def usage_of(url: str, bearer: str, **params: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/usage", params={"bucket_width": "1m", **params},
                  headers={"Authorization": f"Bearer {bearer}"})
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def wait_usage(url: str, bearer: str, requests: int, **params: str) -> list[dict[str, Any]]:
    """The usage report once the accounting app has counted ``requests`` requests."""
    deadline = time.monotonic() + 60
    while True:
        data = usage_of(url, bearer, **params)
        if sum(b["requests"] for b in data) >= requests or time.monotonic() > deadline:
            return data
        time.sleep(0.3)


def token(**claims: Any) -> str:
    payload = {"sub": "svc-1", "tenant": f"t{uuid.uuid4().hex[:8]}",
               "exp": int(time.time()) + 300, **claims}
    signed = jwt.encode({k: v for k, v in payload.items() if v is not None}, JWT_SECRET,
                        algorithm="HS256")
    SECRETS_SEEN.append(signed)
    return signed

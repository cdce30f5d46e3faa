"""The authenticated gateway through Redis failures, against real processes.

One Conveyor with ``CONVEYOR_AUTH=keys`` on a redis-server of its own serves
the module (one worker with one context, one-token answers). Every fault a
test makes is undone before it ends (Redis started again, its data restored
from the ``keys`` topic), so the tests share it. They run in file order: the
first outage needs the main gateway alone (while Redis is down each gateway
keeps its share of a limit: the limit divided by the gateways it last saw
alive), the later tests add replicas of their own.

What they hold the gateway to:

- Redis stopped: a key the gateway used within ``key_cache_s`` keeps working
  (the pipeline answers without Redis: 200, not a 503); a key it never saw is
  a 503 ``pipeline_unavailable``, never a 401 (the key may be good) nor a 500;
  a limited key is held to the gateway's share of its limit in the default
  ``share`` mode, or refused with a 503 in ``closed`` mode; and everything
  works again once Redis is back, with no process restarted.
- Redis flushed: keys, revocations and tenant limits come back from the
  ``keys`` topic, and new keys can be made.
- A gateway killed mid-answer leaks its key's concurrency slot only until the
  request's deadline.
- A revocation made as Redis comes back reaches replicas whose subscription
  was cut.

- The first requests after Redis returns are answered (the gateway's Redis
  client retries a connection that died with the old server), and a cached
  key whose tenant policy is not cached gets 503 while Redis is down, never 500.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from tests.support.pipeline import Pipeline
from tests.support.services import OwnRedis

SECRET = "conveyor-test-auth-faults-secret-" + uuid.uuid4().hex
LEASE_TTL_S = 3.0  # a killed gateway stops counting as alive this soon
SHARE_NOTE = "This gateway's share of the limit: Redis is unreachable."
SHORT_CACHE_S = 6.0  # key_cache_s of the replica that tests its bound
DEADLINE_S = 10.0  # X-Conveyor-Timeout of the request whose gateway is killed


class Faulty:
    """The module's Conveyor, its own Redis, and its gateways by name."""

    def __init__(self, p: Pipeline, server: OwnRedis) -> None:
        self.p = p
        self.server = server
        self.urls: dict[str, str] = {"gateway": p.base_url}

    def key(self, *args: str, tenant: str | None = None) -> tuple[str, str]:
        """A new key (id, secret), of a tenant of its own unless one is named."""
        tenant = tenant or f"t{uuid.uuid4().hex[:8]}"
        out = self.p.cli("keys", "create", "--tenant", tenant, "--name", "faults", *args)
        found = re.search(r"key_[0-9a-f]{16}", out)
        assert found is not None, out
        return found.group(0), out.strip().splitlines()[-1]

    def replica(self, name: str, **env: str) -> str:
        """A gateway replica (started once for the module); its URL."""
        if name not in self.urls:
            self.urls[name] = self.p.start_gateway(name, **env)
        return self.urls[name]

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.server.url, socket_timeout=5)

    def leases(self) -> int:
        """Reply-partition leases in Redis: the gateways alive."""
        client = self.client()
        try:
            return sum(1 for _ in client.scan_iter(f"{self.p.prefix}:reply-lease:*", count=1000))
        finally:
            client.close()

    @contextlib.contextmanager
    def redis_down(self) -> Iterator[None]:
        """Redis stopped for the block (SIGTERM: it keeps its data on disk) once every
        gateway has noticed; started again after it, whatever happens in it."""
        self.server.stop()
        try:
            self.wait_health(503, within=30)
            yield
        finally:
            if self.server.popen is None:
                self.server.start()

    def wait_health(self, status: int, within: float = 30.0) -> float:
        """Until every gateway's ``/healthz`` answers ``status``; the seconds it took."""
        started = time.monotonic()
        for name, url in self.urls.items():
            while True:
                code, body = health(url)
                if code == status:
                    break
                assert time.monotonic() - started < within, f"{name} /healthz {code}: {body}"
                time.sleep(0.1)
        return time.monotonic() - started


@pytest.fixture(scope="module")
def conveyor(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    server = OwnRedis(tmp_path_factory.mktemp("auth-faults-redis")).start()
    p = Pipeline(tmp_path_factory.mktemp("auth-faults-logs"), CONVEYOR_AUTH="keys",
                 CONVEYOR_AUTH_SECRET=SECRET, CONVEYOR_REDIS_URL=server.url,
                 CONVEYOR_REPLY_LEASE_TTL_S=str(LEASE_TTL_S))
    faulty = Faulty(p, server)
    try:
        p.cli("topics")
        _, p.api_key = faulty.key(tenant="ops")
        p.start(workers=1, contexts=1)
        yield faulty
    finally:
        p.close()
        server.stop(signal.SIGKILL)


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        r = httpx.get(f"{url}/healthz", timeout=5)
    except httpx.HTTPError as exc:
        return 0, {"error": repr(exc)}
    return r.status_code, r.json()


def ask(url: str, secret: str, *, max_tokens: int = 1,
        timeout_s: float | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"}
    if timeout_s is not None:
        headers["X-Conveyor-Timeout"] = str(timeout_s)
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=120,
                      json={"model": "smollm2", "prompt": "Hello", "max_tokens": max_tokens,
                            "temperature": 0})


def outcome(r: httpx.Response) -> tuple[int, str | None]:
    """(status, error code): (200, None) for an answer."""
    if r.status_code == 200:
        return 200, None
    return r.status_code, r.json()["error"]["code"]


ANSWERED = (200, None)
UNAVAILABLE = (503, "pipeline_unavailable")
LIMITED = (429, "rate_limit_exceeded")
REFUSED = (401, "invalid_api_key")


def until(url: str, secret: str, wanted: tuple[int, str | None], within: float
          ) -> tuple[float, list[tuple[int, str | None]]]:
    """Ask until the outcome is ``wanted``: (seconds it took, every outcome seen)."""
    started = time.monotonic()
    seen: list[tuple[int, str | None]] = []
    while True:
        seen.append(outcome(ask(url, secret)))
        if seen[-1] == wanted:
            return time.monotonic() - started, seen
        assert time.monotonic() - started < within, f"never {wanted} in {within} s: {seen}"
        time.sleep(0.1)


# -- Redis stopped ----------------------------------------------------------------------

def test_redis_down_cached_keys_serve_unseen_ones_503_limits_keep_the_share(
        conveyor: Faulty) -> None:
    url = conveyor.urls["gateway"]
    _, used = conveyor.key()
    _, unseen = conveyor.key()
    _, limited = conveyor.key("--rpm", "4")
    assert outcome(ask(url, used)) == ANSWERED
    assert outcome(ask(url, limited)) == ANSWERED  # 1 of its 4 in Redis's minute
    assert conveyor.leases() == 1  # this gateway alone: its share is the whole limit
    with conveyor.redis_down():
        t0 = time.monotonic()
        assert outcome(ask(url, used)) == ANSWERED  # the pipeline needs no Redis
        assert outcome(ask(url, unseen)) == UNAVAILABLE
        assert outcome(ask(url, "cvy-" + "0" * 40)) == UNAVAILABLE  # it might be a key
        assert outcome(ask(url, "not-a-key")) == REFUSED  # it cannot be one
        burst = [ask(url, limited) for _ in range(7)]
        assert Counter(map(outcome, burst)) == {ANSWERED: 4, LIMITED: 3}
        refused = burst[-1]
        assert SHARE_NOTE in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == "4"
        print(f"\noutage answers in {time.monotonic() - t0:.2f} s")
    print(f"healthy {conveyor.wait_health(200):.2f} s after Redis started")
    # no process restarted: keys only Redis knows work again, limits count in Redis
    for secret in (unseen, used):
        took, seen = until(url, secret, ANSWERED, within=10)
        assert set(seen) <= {ANSWERED, UNAVAILABLE}, seen
        print(f"answered again after {took:.2f} s: {seen}")
    took, seen = until(url, limited, LIMITED, within=10)
    assert set(seen) <= {ANSWERED, LIMITED, UNAVAILABLE}, seen
    refused = ask(url, limited)
    assert outcome(refused) == LIMITED
    assert SHARE_NOTE not in refused.json()["error"]["message"], refused.text
    print(f"limited by Redis again after {took:.2f} s: {seen}")


def test_requests_are_answered_as_soon_as_healthz_is_200_again(conveyor: Faulty) -> None:
    url = conveyor.urls["gateway"]
    cached = [conveyor.key()[1] for _ in range(6)]
    unseen = [conveyor.key()[1] for _ in range(6)]

    def burst(secrets: list[str]) -> list[tuple[int, str | None]]:
        with ThreadPoolExecutor(len(secrets)) as pool:
            return [outcome(r) for r in pool.map(lambda s: ask(url, s), secrets)]

    # six at once: the gateway's Redis client holds several connections, as under load
    assert burst(cached) == [ANSWERED] * 6
    with conveyor.redis_down():
        assert burst(cached) == [ANSWERED] * 6
    conveyor.wait_health(200)
    outcomes = burst(cached + unseen)
    print(f"\nfirst answers once /healthz is 200: {outcomes}")
    assert outcomes == [ANSWERED] * 12


def test_closed_mode_refuses_limited_keys_while_redis_is_down(conveyor: Faulty) -> None:
    url = conveyor.replica("closed", CONVEYOR_LIMITS_WHEN_REDIS_DOWN="closed")
    _, limited = conveyor.key("--rpm", "4")
    _, free = conveyor.key()
    assert outcome(ask(url, limited)) == ANSWERED
    assert outcome(ask(url, free)) == ANSWERED
    with conveyor.redis_down():
        refusals = [ask(url, limited) for _ in range(3)]
        assert [outcome(r) for r in refusals] == [UNAVAILABLE] * 3
        assert refusals[0].headers["retry-after"] == "1"
        assert "Rate limits cannot be checked" in refusals[0].json()["error"]["message"]
        assert outcome(ask(url, free)) == ANSWERED  # no limit to check: served
    conveyor.wait_health(200)
    took, seen = until(url, limited, ANSWERED, within=10)
    assert set(seen) <= {ANSWERED, UNAVAILABLE}, seen
    print(f"\nclosed mode answers again after {took:.2f} s: {seen}")


def test_a_cached_key_whose_tenant_is_not_cached_is_never_a_500(conveyor: Faulty) -> None:
    url = conveyor.replica("short-cache", CONVEYOR_KEY_CACHE_S=str(SHORT_CACHE_S))
    tenant = f"t{uuid.uuid4().hex[:8]}"
    _, first = conveyor.key(tenant=tenant)
    _, second = conveyor.key(tenant=tenant)
    _, listing = conveyor.key()
    first_used = time.monotonic()
    assert outcome(ask(url, first)) == ANSWERED  # the tenant's policy is cached from now
    time.sleep(SHORT_CACHE_S / 2)
    assert outcome(ask(url, second)) == ANSWERED  # this key's entry is younger
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {listing}"})
    assert models.status_code == 200  # the key is cached; its tenant is not
    with conveyor.redis_down():
        time.sleep(max(0.0, first_used + SHORT_CACHE_S + 0.5 - time.monotonic()))
        outcomes = [outcome(ask(url, second)), outcome(ask(url, listing))]
        assert set(outcomes) <= {ANSWERED, UNAVAILABLE}, outcomes
    conveyor.wait_health(200)


def test_a_revocation_reaches_replicas_whose_subscription_was_cut(conveyor: Faulty) -> None:
    urls = [conveyor.urls["gateway"], conveyor.replica("closed",
                                                     CONVEYOR_LIMITS_WHEN_REDIS_DOWN="closed")]
    key_id, secret = conveyor.key()
    assert [outcome(ask(url, secret)) for url in urls] == [ANSWERED] * 2
    with conveyor.redis_down():
        for url in urls:
            assert health(url)[1]["tasks"]["key-cache"]["state"] == "degraded"
        assert [outcome(ask(url, secret)) for url in urls] == [ANSWERED] * 2
    # revoked the moment Redis answers, before the replicas are subscribed again
    conveyor.p.cli("keys", "revoke", key_id)
    revoked = time.monotonic()
    for url in urls:
        seen: list[tuple[int, str | None]] = []
        while not seen or seen[-1] != REFUSED:
            asked = time.monotonic()
            seen.append(outcome(ask(url, secret)))
            # served when asked 2 s after: too late (a refusal that is slow to come
            # back on a loaded machine is a refusal in time)
            assert seen[-1] == REFUSED or asked - revoked < 2.0, \
                f"{url} still serves it: {seen}"
            time.sleep(0.05)
        print(f"\nrefused on {url} {time.monotonic() - revoked:.2f} s after the revocation "
              f"returned: {Counter(seen)}")
        # once refused, refused for good (how soon is the bound above: a replica
        # on a loaded machine took a second to hear of it)
        assert [outcome(ask(url, secret)) for _ in range(3)] == [REFUSED] * 3
    conveyor.wait_health(200)


# -- Redis flushed -------------------------------------------------------------------------

def test_a_flush_loses_no_key_no_revocation_and_no_tenant_limit(conveyor: Faulty) -> None:
    urls = [conveyor.urls["gateway"], conveyor.replica("closed",
                                                     CONVEYOR_LIMITS_WHEN_REDIS_DOWN="closed")]
    main = urls[0]
    tenant = f"t{uuid.uuid4().hex[:8]}"
    conveyor.p.cli("tenants", "set", tenant, "--rpm", "2")
    _, of_tenant = conveyor.key(tenant=tenant)
    _, used = conveyor.key()
    _, unused = conveyor.key()
    revoked_id, revoked = conveyor.key()
    assert outcome(ask(main, of_tenant)) == ANSWERED  # 1 of the tenant's 2
    assert [outcome(ask(url, used)) for url in urls] == [ANSWERED] * 2
    assert [outcome(ask(url, revoked)) for url in urls] == [ANSWERED] * 2
    conveyor.p.cli("keys", "revoke", revoked_id)
    assert [outcome(ask(url, revoked)) for url in urls] == [REFUSED] * 2
    conveyor.server.flush()
    client = conveyor.client()
    try:
        assert not client.exists(f"{conveyor.p.prefix}:keys:all")  # it is all gone
        t0 = time.monotonic()
        assert outcome(ask(main, unused)) == ANSWERED  # from the topic
        print(f"\na key only the topic knows answered in {time.monotonic() - t0:.2f} s")
        assert client.exists(f"{conveyor.p.prefix}:keys:restored")
        assert client.exists(f"{conveyor.p.prefix}:tenant:{tenant}")
    finally:
        client.close()
    for url in urls:
        assert outcome(ask(url, used)) == ANSWERED
        assert outcome(ask(url, revoked)) == REFUSED
        assert outcome(ask(url, unused)) == ANSWERED
    # the flush took the tenant's minute with it, not its limit: 2 more, then 429
    burst = [ask(main, of_tenant) for _ in range(3)]
    assert [outcome(r) for r in burst] == [ANSWERED, ANSWERED, LIMITED]
    assert f"tenant {tenant}" in burst[-1].json()["error"]["message"]
    _, new = conveyor.key()
    assert [outcome(ask(url, new)) for url in urls] == [ANSWERED] * 2
    conveyor.wait_health(200)


# -- a gateway killed ------------------------------------------------------------------------

def test_a_killed_gateways_concurrency_slot_is_free_by_the_deadline(conveyor: Faulty) -> None:
    url = conveyor.replica("doomed")
    _, secret = conveyor.key("--concurrency", "1")
    # a limited request on each gateway first: a cold limiter (its script not loaded,
    # no pooled connection) may miss its 1 s Redis budget and admit on its own share
    _, warm = conveyor.key("--rpm", "100")
    for gateway in (url, conveyor.urls["gateway"]):
        assert outcome(ask(gateway, warm)) == ANSWERED
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
            "max_tokens": 256, "temperature": 0, "seed": 7}
    headers = {"Authorization": f"Bearer {secret}", "X-Conveyor-Timeout": str(DEADLINE_S)}

    def slots() -> int:
        return sum(conveyor.client().zcard(k)
                   for k in conveyor.client().keys("*:ratelimit:key:*:inflight"))

    sent = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        # the gateway dies while the request holds its slot: admitted, not yet answered
        pending = pool.submit(httpx.post, f"{url}/v1/completions", json=body,
                              headers=headers, timeout=30)
        while not slots():
            assert time.monotonic() - sent < 5, "the request never took its slot"
            time.sleep(0.02)
        conveyor.p.kill("doomed", signal.SIGKILL)
        with contextlib.suppress(httpx.HTTPError):
            pending.result()
    killed = time.monotonic() - sent
    del conveyor.urls["doomed"]
    assert slots() == 1  # nobody settled it
    main = conveyor.urls["gateway"]
    asked: list[tuple[float, tuple[int, str | None]]] = []  # (seconds after sending, outcome)
    while not asked or asked[-1][1] != ANSWERED:
        assert time.monotonic() - sent < DEADLINE_S + 10, f"the slot stays taken: {asked}"
        at = time.monotonic() - sent
        r = ask(main, secret)
        asked.append((at, outcome(r)))
        if r.status_code == 429:
            assert "concurrent requests" in r.json()["error"]["message"], r.text
        time.sleep(0.1)
    print(f"\nkilled {killed:.2f} s after sending; last 429 asked at {asked[-2][0]:.2f} s, "
          f"the 200 at {asked[-1][0]:.2f} s (deadline {DEADLINE_S} s); "
          f"{Counter(o for _, o in asked)}")
    assert asked[0][1] == LIMITED  # the dead gateway's slot is taken at first
    assert {o for _, o in asked[:-1]} == {LIMITED}
    assert DEADLINE_S - 0.5 <= asked[-1][0] <= DEADLINE_S + 1.0  # and free at the deadline

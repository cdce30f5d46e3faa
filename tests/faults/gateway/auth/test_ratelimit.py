"""Rate limits and quotas against the real Redis: two RateLimiter instances on
one Redis stand for two gateway replicas, and together admit exactly each
limit; a Redis of the test's own is stopped and flushed to show the fallbacks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from conveyor.errors import PipelineUnavailable, QuotaExceeded, RateLimited
from conveyor.files.local import LocalFileStore
from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from gateway.admission import Admitter
from gateway.auth.ratelimit import Admission, RateLimiter, format_duration
from gateway.auth.ratelimit_windows import Check, Scope
from gateway.auth.types import Identity, Limits, TenantPolicy
from schemas.openai.requests import ChatCompletionRequest
from tests.support.gateway_fakes import image_intake
from tests.support.images import data_url, image_bytes
from tests.support.services import OwnRedis

SHARED_REDIS = "redis://127.0.0.1:6379/0"
HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
           "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
           "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
NOBODY = TenantPolicy("acme")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def duration_ms(text: str) -> float:
    """Parse OpenAI's duration format back (``6m0s``, ``1.5s``, ``120ms``)."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)s)?(?:(\d+)ms)?", text)
    assert match and text, f"not a duration: {text!r}"
    h, m, s, ms = (float(g) if g else 0.0 for g in match.groups())
    return ((h * 60 + m) * 60 + s) * 1000 + ms


def settings(url: str = SHARED_REDIS, **overrides: Any) -> Settings:
    return load_settings(topic_prefix=f"rl{uuid.uuid4().hex[:10]}", redis_url=url, **overrides)


@asynccontextmanager
async def replicas(config: Settings, n: int = 2, warm: bool = True
                   ) -> AsyncIterator[list[RateLimiter]]:
    """``n`` limiters, each with a Redis client of its own, as n gateways have;
    the prefix's keys are removed afterwards."""
    # generous timeouts: a Redis of the test's own that is stopped refuses at once,
    # and the shared one on a loaded machine once took over 2 s to answer
    clients = [aioredis.from_url(config.redis.url, socket_timeout=5.0,
                                 socket_connect_timeout=5.0) for _ in range(n)]
    limiters = [RateLimiter(config, c, f"gw-{i}") for i, c in enumerate(clients)]
    for limiter in limiters:
        # exactness is what these tests are about: an admission that waits out
        # the default 1 s on a loaded machine is counted by the local share as
        # well (the documented fallback), and the scripts are loaded first as
        # a gateway's run() does (unless the test is about that)
        limiter.redis_timeout_s = 5.0
        if warm:
            with contextlib.suppress(OSError, aioredis.RedisError):
                await limiter.windows.warm()
    try:
        yield limiters
    finally:
        try:
            pattern = f"{config.kafka.topic_prefix}:*"
            async for key in clients[0].scan_iter(match=pattern, count=1000):
                await clients[0].delete(key)
        except (OSError, aioredis.RedisError):
            pass  # a Redis of the test's own, stopped: it goes with the test
        for c in clients:
            await c.aclose()


async def admit_many(limiters: Sequence[RateLimiter], identity: Identity | Sequence[Identity],
                     count: int, tokens: int = 1, tenant: TenantPolicy = NOBODY,
                     deadline_ms: int | None = None) -> list[Admission | Exception]:
    """``count`` admissions at once (16 in flight), taking turns between the
    limiters (and identities)."""
    identities = [identity] if isinstance(identity, Identity) else list(identity)
    gate = asyncio.Semaphore(16)
    deadline = deadline_ms or now_ms() + 60_000

    async def one(i: int) -> Admission:
        async with gate:
            return await limiters[i % len(limiters)].admit(
                identities[i % len(identities)], tenant, f"req-{i}", tokens, deadline)

    results = await asyncio.wait_for(
        asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True), 20)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, RateLimited | QuotaExceeded):
            raise r
    return [r for r in results if isinstance(r, Admission | Exception)]


def split(results: list[Admission | Exception]) -> tuple[list[Admission], list[RateLimited]]:
    admitted = [r for r in results if isinstance(r, Admission)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) + len(refused) == len(results)
    return admitted, refused


# -- exact across replicas ------------------------------------------------------

async def test_rpm_is_exact_across_two_replicas() -> None:
    key = Identity("acme", "key_rpm", Limits(rpm=30, tpm=1_000_000))
    async with replicas(settings()) as limiters:
        admitted, refused = split(await admit_many(limiters, key, 90, tokens=10))
    assert len(admitted) == 30 and len(refused) == 60
    assert {a.backend for a in admitted} == {"redis"}
    # every admission saw its own count: atomic across both replicas
    assert sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in admitted) == \
        list(range(30))
    for error in refused:
        assert error.status == 429 and error.type == "requests"
        assert error.code == "rate_limit_exceeded"
        assert error.message.startswith(
            "Rate limit reached for requests per minute (key key_rpm): limit 30, used 30.")
        assert 1 <= int(error.headers["Retry-After"]) <= 60
        assert set(HEADERS) <= set(error.headers)
        assert error.headers["x-ratelimit-limit-requests"] == "30"
        assert error.headers["x-ratelimit-remaining-requests"] == "0"
        assert 50_000 < duration_ms(error.headers["x-ratelimit-reset-requests"]) <= 60_000
        assert error.headers["x-ratelimit-limit-tokens"] == "1000000"
        assert error.headers["x-ratelimit-remaining-tokens"] == str(1_000_000 - 300)
        assert 0 < duration_ms(error.headers["x-ratelimit-reset-tokens"]) <= 60_000


async def test_tpm_is_exact_and_settling_gives_unused_tokens_back() -> None:
    key = Identity("acme", "key_tpm", Limits(tpm=1000))
    async with replicas(settings()) as limiters:
        admitted, refused = split(await admit_many(limiters, key, 30, tokens=100))
        assert len(admitted) == 10 and len(refused) == 20
        error = refused[0]
        assert error.type == "tokens" and "tokens per minute (key key_tpm)" in error.message
        assert "limit 1000, used 1000, requested 100" in error.message
        assert error.headers["x-ratelimit-remaining-tokens"] == "0"
        assert "x-ratelimit-limit-requests" not in error.headers  # rpm is unlimited
        # five short answers used 20 tokens each: 5 * 80 come back, room for 4 more
        for i, admission in enumerate(admitted[:5]):
            await limiters[i % 2].settle(admission, 20)
        later, refused_later = split(await admit_many(limiters, key, 6, tokens=100))
        assert len(later) == 4 and len(refused_later) == 2
        assert sorted(int(x.headers["x-ratelimit-remaining-tokens"]) for x in later) == \
            [0, 100, 200, 300]
        # a reservation over the limit itself could never pass
        with pytest.raises(RateLimited, match="can never fit") as never:
            await limiters[0].admit(key, NOBODY, "huge", 1001, now_ms() + 60_000)
        assert never.value.type == "tokens"


async def test_concurrency_is_exact_settle_frees_and_a_leaked_slot_lapses() -> None:
    key = Identity("acme", "key_conc", Limits(concurrency=3))
    async with replicas(settings()) as (a, b):
        admitted, refused = split(await admit_many([a, b], key, 10))
        assert len(admitted) == 3 and len(refused) == 7
        assert "concurrent requests (key key_conc): limit 3, in flight 3" in refused[0].message
        assert refused[0].headers["Retry-After"] == "1"
        # settled three times (twice through a copy that forgot it was settled):
        # one slot comes free, not three
        first = admitted[0]
        await b.settle(first, 1)
        await b.settle(first, 1)
        await a.settle(dataclasses.replace(first, settled=False), 1)
        again, refused_again = split(await admit_many([a, b], key, 3))
        assert len(again) == 1 and len(refused_again) == 2
        for admission in [*admitted[1:], *again]:
            await a.settle(admission, 1)
        # a gateway that dies never settles: its slots lapse at their deadline
        dying = now_ms() + 400
        leaked, _ = split(await admit_many([b], key, 3, deadline_ms=dying))
        assert len(leaked) == 3
        with pytest.raises(RateLimited):
            await a.admit(key, NOBODY, "while-leaked", 1, now_ms() + 60_000)
        await asyncio.sleep(max(0.0, (dying - now_ms()) / 1000) + 0.05)
        healed = await a.admit(key, NOBODY, "after-deadline", 1, now_ms() + 60_000)
        assert healed.backend == "redis"


async def test_with_redis_down_images_wait_on_the_limits_as_admission_does(
        own_redis: OwnRedis, tmp_path: Path) -> None:
    """Redis stopped: the look before the images answers from this gateway's share
    (limits open) or refuses with a 503 before any image is read (closed)."""
    config = settings(own_redis.url, files_dir=tmp_path)
    registry = Registry.parse('[models."eyes"]\npool = "eyes"\ncontext_length = 8192\n'
                              'vision = true\n', "test")
    key = Identity("acme", "key_down_eyes", Limits(rpm=5))
    parsed = ChatCompletionRequest.model_validate({"model": "eyes", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": data_url(image_bytes())}}]}]})
    files = LocalFileStore(config.jobs)
    own_redis.stop()
    async with replicas(config, n=1, warm=False) as (limiter,):
        intake = image_intake(config, registry, Admitter(registry, limiter))
        assert len(await intake.refs(parsed, key)) == 1  # open: the local share had room
        # and the look counted nothing there: a window of one still has its one
        assert limiter.local.admit(Check(member="m", tokens=1, deadline_ms=now_ms() + 60_000,
                                         scopes=(Scope("key:key_down_eyes", "key",
                                                       Limits(rpm=1)),)), 1).admitted
    closing = config.replace(limits_when_redis_down="closed")
    async with replicas(closing, n=1, warm=False) as (closed,):
        intake = image_intake(closing, registry, Admitter(registry, closed))
        with pytest.raises(PipelineUnavailable, match="Redis is unreachable"):
            await intake.refs(parsed, key)
    assert len((await files.list("acme")).data) == 1


async def test_a_tenant_limit_binds_across_its_keys() -> None:
    tenant = TenantPolicy("acme-t", limits=Limits(rpm=5, tpm=10_000))
    keys = [Identity("acme-t", "key_one", Limits(rpm=10)), Identity("acme-t", "key_two")]
    async with replicas(settings()) as limiters:
        admitted, refused = split(await admit_many(limiters, keys, 12, tokens=10,
                                                   tenant=tenant))
    assert len(admitted) == 5 and len(refused) == 7
    assert all("(tenant acme-t): limit 5, used 5." in e.message for e in refused)
    # the tighter scope is reported: the tenant's 5, not key_one's 10
    for admission in admitted:
        assert admission.headers["x-ratelimit-limit-requests"] == "5"
        assert admission.headers["x-ratelimit-limit-tokens"] == "10000"
    remaining = sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in admitted)
    assert remaining == [0, 1, 2, 3, 4]


async def test_a_refused_request_counts_nowhere() -> None:
    config = settings()
    tenant = TenantPolicy("wide-t", limits=Limits(rpm=100))
    key = Identity("wide-t", "key_narrow", Limits(rpm=2))
    async with replicas(config) as limiters:
        admitted, refused = split(await admit_many(limiters, key, 5, tenant=tenant))
        assert len(admitted) == 2 and len(refused) == 3
        assert "(key key_narrow)" in refused[0].message
        tenant_window = f"{config.kafka.topic_prefix}:ratelimit:tenant:wide-t:requests"
        assert await limiters[0].redis.zcard(tenant_window) == 2


async def test_quotas_read_the_usage_mirror() -> None:
    config = settings()
    tenant = TenantPolicy("quota-t", daily_tokens=1000, monthly_tokens=50_000)
    key = Identity("quota-t", "key_q")  # no rate limits: quotas alone still check
    today = datetime.now(UTC)
    day = f"{config.kafka.topic_prefix}:usage:quota-t:day:{today:%Y-%m-%d}"
    month = f"{config.kafka.topic_prefix}:usage:quota-t:month:{today:%Y-%m}"
    async with replicas(config, n=1) as (limiter,):
        assert (await limiter.admit(key, tenant, "q0", 10, now_ms() + 1000)).headers == {}
        await limiter.redis.set(day, 999)
        await limiter.admit(key, tenant, "q1", 10, now_ms() + 1000)
        await limiter.redis.set(day, 1000)
        with pytest.raises(QuotaExceeded, match="daily token quota") as daily:
            await limiter.admit(key, tenant, "q2", 10, now_ms() + 1000)
        assert daily.value.status == 429 and daily.value.code == "insufficient_quota"
        assert "1000 of 1000 tokens used" in daily.value.message
        assert 1 <= int(daily.value.headers["Retry-After"]) <= 86_400
        await limiter.redis.set(day, 0)
        await limiter.redis.set(month, 50_001)
        with pytest.raises(QuotaExceeded, match="monthly token quota") as monthly:
            await limiter.admit(key, tenant, "q3", 10, now_ms() + 1000)
        assert 1 <= int(monthly.value.headers["Retry-After"]) <= 31 * 86_400


# -- Redis down, flushed, not needed --------------------------------------------

async def wait_for(condition: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_redis_down_shares_or_closes_and_recovery_returns_to_redis(
        own_redis: OwnRedis) -> None:
    config = settings(own_redis.url, reply_lease_ttl_s=0.9)  # gateways counted every 0.3 s
    key = Identity("acme", "key_down", Limits(rpm=30))
    async with replicas(config) as (a, b):
        for p in range(2):  # two live gateways hold reply leases
            await a.redis.set(f"{config.kafka.topic_prefix}:reply-lease:{p}", f"gw-{p}", px=60_000)
        runners = [asyncio.create_task(limiter.run()) for limiter in (a, b)]
        try:
            await wait_for(lambda: a.live_gateways == 2 and b.live_gateways == 2)
            before = await a.admit(key, NOBODY, "before", 1, now_ms() + 60_000)
            assert before.backend == "redis"
            own_redis.stop()
            await b.settle(before, 1)  # Redis gone: settling says so and returns
            # each replica enforces half of the limit on its own
            shared = [await admit_many([limiter], key, 40) for limiter in (a, b)]
            for results in shared:
                admitted, refused = split(results)
                assert len(admitted) == 15 and {x.backend for x in admitted} == {"local"}
                assert "This gateway's share" in refused[0].message
            assert not a.redis_up and a.health.state == "degraded"
            closing = config.replace(limits_when_redis_down="closed")
            async with replicas(closing, n=1) as (closed,):
                with pytest.raises(PipelineUnavailable, match="Redis is unreachable"):
                    await closed.admit(key, NOBODY, "closed", 1, now_ms() + 60_000)
            own_redis.start()
            fresh = Identity("acme", "key_back", Limits(rpm=30))
            back: list[Admission] = []

            async def admitted_by_redis() -> bool:
                try:  # meanwhile admitted (or refused) locally, on this gateway's share
                    back.append(await a.admit(fresh, NOBODY, f"back-{len(back)}", 1,
                                              now_ms() + 60_000))
                except RateLimited:
                    return False
                return back[-1].backend == "redis"

            deadline = time.monotonic() + 10
            while not await admitted_by_redis():
                assert time.monotonic() < deadline, "never went back to Redis"
                await asyncio.sleep(0.05)
            counted = await a.redis.zcard(f"{config.kafka.topic_prefix}:ratelimit:key:key_back:"
                                          "requests")
            assert counted == 1 and a.redis_up
            await wait_for(lambda: b.redis_up and b.health.state == "ok")
            assert not any(r.done() for r in runners)
        finally:
            for r in runners:
                r.cancel()
            await asyncio.gather(*runners, return_exceptions=True)


async def test_a_flush_mid_flight_neither_goes_negative_nor_stops_admissions(
        own_redis: OwnRedis) -> None:
    config = settings(own_redis.url)
    key = Identity("acme", "key_flush", Limits(tpm=1000, concurrency=5))
    tokens_n = f"{config.kafka.topic_prefix}:ratelimit:key:key_flush:tokens:n"
    async with replicas(config) as (a, b):
        before, _ = split(await admit_many([a, b], key, 3, tokens=200))
        assert len(before) == 3
        own_redis.flush()
        await a.settle(before[0], 50)  # its entries are gone: nothing to correct
        assert await a.redis.keys(f"{config.kafka.topic_prefix}:*") == []
        after, refused = split(await admit_many([a, b], key, 6, tokens=200))
        assert len(after) == 5 and len(refused) == 1  # a fresh window, full again
        for admission in before[1:]:
            await b.settle(admission, 0)
        assert await a.redis.hget(tokens_n, "#sum") == b"1000"
        await a.settle(after[0], 40)
        assert await a.redis.hget(tokens_n, "#sum") == b"840"
        assert await a.redis.zcard(f"{config.kafka.topic_prefix}:ratelimit:key:key_flush:"
                                   "inflight") == 4


async def test_an_unlimited_identity_never_asks_redis(own_redis: OwnRedis) -> None:
    config = settings(own_redis.url, limits_when_redis_down="closed")
    own_redis.stop()
    async with replicas(config, n=1) as (limiter,):
        admission = await limiter.admit(Identity("acme", "key_free"), NOBODY, "free", 10**6,
                                        now_ms() + 1000)
        assert admission.headers == {} and admission.backend == "none"
        await limiter.settle(admission, 10)
        assert limiter.redis_up  # never tried


def test_durations_are_written_as_openai_writes_them() -> None:
    assert [format_duration(ms) for ms in (0, 120, 1000, 1500, 59_999, 360_000, 3_723_000)] \
        == ["0ms", "120ms", "1s", "1.5s", "59.999s", "6m0s", "1h2m3s"]


async def test_the_scripts_are_loaded_at_start_and_again_after_redis_comes_back(
        own_redis: OwnRedis) -> None:
    """An admission's first EVALSHA must not pay for loading the script inside its
    1 s budget (a cold limiter on a loaded machine fell back to its local share)."""
    config = settings(own_redis.url)
    async with replicas(config, n=1, warm=False) as (limiter,):
        limiter.count_every_s = 0.1
        shas = [limiter.windows._admit.sha, limiter.windows._settle.sha]

        async def loaded(within_s: float) -> bool:
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline:
                try:
                    if all(await limiter.redis.script_exists(*shas)):
                        return True
                except (OSError, aioredis.RedisError):
                    pass
                await asyncio.sleep(0.05)
            return False

        assert not any(await limiter.redis.script_exists(*shas))
        task = asyncio.create_task(limiter.run())
        try:
            assert await loaded(5), "not loaded at start"
            own_redis.stop()  # a restarted Redis has an empty script cache
            deadline = time.monotonic() + 10
            while limiter.redis_up:
                assert time.monotonic() < deadline, "the outage was not noticed"
                await asyncio.sleep(0.05)
            own_redis.start()
            assert await loaded(10), "not loaded again after Redis came back"
        finally:
            task.cancel()

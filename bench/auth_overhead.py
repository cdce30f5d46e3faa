"""What authentication and rate limits cost on Conveyor's hot path.

One pipeline (the upstream fixture, ``conveyor layer``, ``conveyor infer
--engine openai``) serves two gateways on the same topic prefix: one with
``CONVEYOR_AUTH=none`` and one with ``CONVEYOR_AUTH=keys``. The keyed side
sends ``Authorization: Bearer <key>`` for a key whose limits (rpm, tpm,
concurrency) and whose tenant's limits (the same, plus a daily token quota)
are generous but set, so every request is identified (the key cache, a
Redis lookup when its entry lapses), admitted by the admission script on
both scopes and the quota, and settled when its answer ends. The only
difference between the sides is auth and limits:

- ``c1-paced``: concurrency 1, 32 tokens x 10 ms, one request a side in
  alternating pairs; the figure is the paired TTFT difference (keys - none);
- ``c32-unpaced``: alternating rounds of 32 concurrent streams with an
  unpaced upstream, the pipeline's own limit; the figure is each side's rate.

Targets (the issue of record): auth plus limits add at most 1 ms to TTFT
p50 at concurrency 1, and cost at most 5 % of the unpaced c=32 rate.

The sides run in pairs and rounds whose first side alternates
(``bench.compare``): the keyed gateway settles in the background after its
answer has ended, so a fixed order would bill part of that work to the open side.

    python -m bench.auth_overhead [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from bench import compare
from bench.client import make_client
from bench.compare import (
    Comparison,
    first_success,
    loop_factory,
    paired_checks,
    plan,
    report_main,
    staged,
)
from bench.harness import (
    BenchError,
    conveyor_env,
    run_cli,
    running,
    wait_http,
)
from bench.scenarios import PROMPT, TOKENS, Result, Scenario, Side
from conveyor.settings import load_settings

__all__ = ["main"]

TENANT = "bench-auth"
# generous but enforced: every request runs the whole admission script
KEY_LIMITS = ["--rpm", "1000000", "--tpm", "1000000000", "--concurrency", "1000"]
TENANT_LIMITS = KEY_LIMITS + ["--daily-tokens", "1000000000000"]
TTFT_TARGET_MS = 1.0
RATE_TARGET = 0.95

async def _check_enforced(keyed_url: str, secret: str) -> None:
    """The keyed gateway refuses a request without the key and answers one with
    it with the x-ratelimit-* headers of its limits: auth and limits really run."""
    body = {"model": "bench-unpaced", "prompt": PROMPT, "max_tokens": TOKENS}
    url = f"{keyed_url}/v1/completions"
    async with httpx.AsyncClient(timeout=30.0) as client:
        bare = await client.post(url, json=body)
        keyed = await client.post(url, json=body, headers={"Authorization": f"Bearer {secret}"})
    if bare.status_code != 401:
        raise BenchError(f"the keyed gateway answered {bare.status_code} without a key, not 401")
    if keyed.status_code != 200 or "x-ratelimit-limit-requests" not in keyed.headers:
        raise BenchError(f"the keyed gateway answered {keyed.status_code} without rate-limit "
                         f"headers: {keyed.text[:200]}")
    limits = {k: v for k, v in keyed.headers.items() if k.startswith("x-ratelimit-limit")}
    print(f"keyed gateway: 401 without the key; with it 200 and {limits}", flush=True)


async def _in_flight(redis_url: str, prefix: str, key_id: str) -> dict[str, int]:
    """Concurrency slots still held per scope: 0 once every request is settled."""
    redis = aioredis.from_url(redis_url)
    try:
        counts: dict[str, int] = {}
        for scope in (f"key:{key_id}", f"tenant:{TENANT}"):
            counts[scope] = int(await redis.zcard(f"{prefix}:ratelimit:{scope}:inflight"))
        return counts
    finally:
        await redis.aclose()


async def measure(scenarios: list[Scenario], open_url: str, keyed_url: str,
                  secret: str) -> list[Result]:
    async with make_client() as open_client, make_client() as keyed_client:
        keyed_client.headers["Authorization"] = f"Bearer {secret}"
        models = {True: "bench-paced", False: "bench-unpaced"}
        open_ = Side("none", f"{open_url}/v1/completions", models, open_client)
        keyed = Side("keys", f"{keyed_url}/v1/completions", models, keyed_client)
        await first_success(keyed, 90.0)
        await _check_enforced(keyed_url, secret)
        return await compare.measure(scenarios, open_, keyed, AUTH)


# Targets


AUTH = Comparison("none", "keys", "Auth overhead: CONVEYOR_AUTH=keys (key + tenant limits) vs. "
                  "none", paired_checks("none", "keys", TTFT_TARGET_MS, RATE_TARGET),
                  fine=True)


# Processes


def make_key(script: Path, env: dict[str, str]) -> tuple[str, str]:
    """The tenant's limits, then a key with its own: (key id, secret)."""
    run_cli(script, ["tenants", "set", TENANT, *TENANT_LIMITS], env)
    out = run_cli(script, ["keys", "create", "--tenant", TENANT, "--name", "bench",
                        *KEY_LIMITS], env).strip().splitlines()
    created = next((line for line in out if line.startswith("created ")), "")
    if not created or not out[-1].startswith("cvy-"):
        raise BenchError(f"unexpected output of `conveyor keys create`: {out[:1]}")
    return created.split()[1], out[-1].strip()


def run(quick: bool, upstream_port: int, open_port: int, keyed_port: int) -> list[Result]:
    ports = {open_port: "gateway (auth none)", keyed_port: "gateway (auth keys)"}
    with staged(upstream_port, ports) as (stage, stack):
        script, work = stage.script, stage.work
        prefix = f"benchauth{int(time.time())}"
        open_url, keyed_url = f"http://127.0.0.1:{open_port}", f"http://127.0.0.1:{keyed_port}"
        base = conveyor_env(topic_prefix=prefix, gateway_port=open_port,
                            models_file=stage.models)
        base["CONVEYOR_AUTH"] = "none"
        base.pop("CONVEYOR_AUTH_SECRET", None)
        keyed_env = {**base, "CONVEYOR_AUTH": "keys", "CONVEYOR_GATEWAY_PORT": str(keyed_port),
                     "CONVEYOR_AUTH_SECRET": secrets.token_hex(32)}
        infer_argv = [str(script), "infer", "--engine", "openai", "--upstream",
                      stage.upstream_url, "--pool", "bench", "--capacity", "64",
                      "--worker-id", "bench-0"]
        key_id, secret = make_key(script, keyed_env)
        print(f"key {key_id} of tenant {TENANT} on topic prefix {prefix}", flush=True)
        stack.enter_context(running("layers", [str(script), "layer"], work, base))
        stack.enter_context(running("infer", infer_argv, work, base))
        open_gw = stack.enter_context(running("gateway-none", [str(script), "gateway"], work,
                                              base))
        keyed_gw = stack.enter_context(running("gateway-keys", [str(script), "gateway"], work,
                                               keyed_env))
        wait_http(f"{open_url}/healthz", open_gw, 180.0)
        wait_http(f"{keyed_url}/healthz", keyed_gw, 180.0)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            results = runner.run(measure(plan(quick), open_url, keyed_url, secret))
            runner.run(asyncio.sleep(1.0))  # background settles finish
            redis_url = load_settings().redis_url  # the one the gateways use
            held = runner.run(_in_flight(redis_url, prefix, key_id))
        print(f"concurrency slots still held after the run (0: every request settled): {held}")
        return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.auth_overhead",
        description="What CONVEYOR_AUTH=keys with key and tenant limits adds over no auth.")
    parser.add_argument("--quick", action="store_true", help="about 5x fewer requests")
    parser.add_argument("--upstream-port", type=int, default=9110)
    parser.add_argument("--open-port", type=int, default=8110,
                        help="the CONVEYOR_AUTH=none gateway")
    parser.add_argument("--keyed-port", type=int, default=8111,
                        help="the CONVEYOR_AUTH=keys gateway")
    args = parser.parse_args(argv)
    report_main("bench.auth_overhead", AUTH, lambda: run(
        args.quick, args.upstream_port, args.open_port, args.keyed_port))

if __name__ == "__main__":
    main()

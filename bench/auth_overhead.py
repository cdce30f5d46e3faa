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

Which side goes first alternates from pair to pair and from round to round
(A B, B A, ...): the keyed gateway settles in the background after its answer
has ended, so a fixed order would bill part of that work to the open side.

    python -m bench.auth_overhead [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis.asyncio as aioredis

from bench.client import Sample, make_client
from bench.harness import (
    BenchError,
    check_infra,
    check_port_free,
    conveyor_env,
    conveyor_script,
    exit_on_sigterm,
    repo_root,
    running,
    wait_http,
)
from bench.scenarios import DELAY_MS, PROMPT, TOKENS, Result, Scenario, Side, Tally
from bench.stats import Check, markdown_table, ms, percentile
from conveyor.settings import load_settings

__all__ = ["main", "run_alternating_pairs", "run_alternating_rounds"]

TENANT = "bench-auth"
# generous but enforced: every request runs the whole admission script
KEY_LIMITS = ["--rpm", "1000000", "--tpm", "1000000000", "--concurrency", "1000"]
TENANT_LIMITS = KEY_LIMITS + ["--daily-tokens", "1000000000000"]
TTFT_TARGET_MS = 1.0
RATE_TARGET = 0.95

T = TypeVar("T")

REGISTRY = "\n".join(
    f'[models."{name}"]\npool = "bench"\ncontext_length = 8192\ndefault_max_tokens = 64\n'
    f'tokenizer = "estimate"\nupstream_model = "{upstream}"\n'
    for name, upstream in (("bench-paced", f"bench@{DELAY_MS}"), ("bench-unpaced", "bench@0")))


def plan(quick: bool) -> list[Scenario]:
    paced = f"{TOKENS} tokens x {DELAY_MS} ms"
    unpaced = f"concurrency 32, {TOKENS} tokens unpaced"
    if quick:
        return [Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, 4, 60, 25.0),
                Scenario("c32-unpaced", unpaced, 32, False, 2, 512, 4.0, 2)]
    return [Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, 20, 300, 120.0),
            Scenario("c32-unpaced", unpaced, 32, False, 2, 2560, 20.0, 4)]


class FineCheck(Check):
    """A check whose figure needs two decimals (a target of 1 ms)."""

    def measured(self) -> str:
        return "-" if math.isnan(self.value) else f"{self.value:.2f} {self.unit}"


# Measurement: which side goes first alternates (see the module's docstring)


async def _timed(side: Side, paced: bool, tally: Tally) -> Sample:
    start = time.perf_counter()
    sample = await side.one(paced)
    tally.samples.append(sample)
    tally.busy_s += time.perf_counter() - start
    return sample


async def _in_turn(i: int, open_step: Callable[[], Awaitable[T]],
                   keyed_step: Callable[[], Awaitable[T]]) -> tuple[T, T]:
    """Both steps, the open side's first when ``i`` is even: (open, keyed)."""
    if i % 2 == 0:
        o = await open_step()
        return o, await keyed_step()
    k = await keyed_step()
    return await open_step(), k


async def run_alternating_pairs(sc: Scenario, open_: Side, keyed: Side) -> Result:
    """Concurrency 1: pairs of one request a side, the first side alternating.
    The result's ``direct`` is the open side, ``conveyor`` the keyed one."""
    result = Result(sc)
    for _ in range(sc.warmup):
        await open_.one(sc.paced)
        await keyed.one(sc.paced)
    for i in range(sc.max_requests):
        if max(result.direct.busy_s, result.conveyor.busy_s) >= sc.window_s:
            break
        result.pairs.append(await _in_turn(
            i, lambda: _timed(open_, sc.paced, result.direct),
            lambda: _timed(keyed, sc.paced, result.conveyor)))
    return result


async def _round(sc: Scenario, side: Side, tally: Tally | None, per_worker: int) -> list[Sample]:
    async def lane() -> list[Sample]:
        return [await side.one(sc.paced) for _ in range(per_worker)]

    start = time.perf_counter()
    lanes = await asyncio.gather(*(lane() for _ in range(sc.concurrency)))
    samples = [one[i] for i in range(per_worker) for one in lanes]
    if tally is not None:
        tally.samples.extend(samples)
        tally.busy_s += time.perf_counter() - start
    return samples


async def run_alternating_rounds(sc: Scenario, open_: Side, keyed: Side) -> Result:
    """Concurrency N: a round of N streams a side, the first side alternating."""
    result = Result(sc)
    for _ in range(sc.warmup):
        await _round(sc, open_, None, 1)
        await _round(sc, keyed, None, 1)
    i = 0
    while (max(len(result.direct.samples), len(result.conveyor.samples)) < sc.max_requests
           and max(result.direct.busy_s, result.conveyor.busy_s) < sc.window_s):
        o, k = await _in_turn(i, lambda: _round(sc, open_, result.direct, sc.per_worker),
                              lambda: _round(sc, keyed, result.conveyor, sc.per_worker))
        result.pairs.extend(zip(o, k, strict=True))
        i += 1
    return result


async def _first_success(side: Side, timeout_s: float) -> None:
    """The first request can fail while the layers' consumers join their groups."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        sample = await side.one(paced=False)
        if sample.ok:
            return
        last = sample.error or ""
        await asyncio.sleep(0.5)
    raise BenchError(f"{side.name}: no successful request within {timeout_s:.0f} s: {last}")


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
    results: list[Result] = []
    async with make_client() as open_client, make_client() as keyed_client:
        keyed_client.headers["Authorization"] = f"Bearer {secret}"
        models = {True: "bench-paced", False: "bench-unpaced"}
        open_ = Side("none", f"{open_url}/v1/completions", models, open_client)
        keyed = Side("keys", f"{keyed_url}/v1/completions", models, keyed_client)
        await _first_success(open_, 90.0)
        await _first_success(keyed, 90.0)
        await _check_enforced(keyed_url, secret)
        for sc in scenarios:
            runner: Callable[[Scenario, Side, Side], Coroutine[Any, Any, Result]]
            runner = run_alternating_pairs if sc.concurrency == 1 else run_alternating_rounds
            print(f"running {sc.key}: {sc.title} ...", flush=True)
            try:
                result = await asyncio.wait_for(runner(sc, open_, keyed), sc.hard_limit_s)
            except TimeoutError as exc:
                raise BenchError(f"{sc.key} ran past {sc.hard_limit_s:.0f} s") from exc
            report_scenario(result)
            results.append(result)
    return results


# Reporting


def _ms2(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.2f}"


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free ~95 % confidence interval of the median (order
    statistics n/2 -+ 0.98 sqrt(n)); NaN when there are too few values."""
    n = len(values)
    if n < 10:
        return math.nan, math.nan
    ordered = sorted(values)
    half = 0.98 * math.sqrt(n)
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half))]


def checks(result: Result) -> list[Check]:
    key = result.scenario.key
    if key == "c1-paced":
        added = percentile(result.added_ttft(), 50) * 1000
        return [FineCheck(key, "added TTFT p50 (keys - none, paired)", added, TTFT_TARGET_MS,
                          "<=", "ms")]
    open_rate, keyed_rate = result.direct.rate, result.conveyor.rate
    return [Check(key, f"keys rate (>= {RATE_TARGET:.0%} of none's {open_rate:.1f})",
                  keyed_rate, round(RATE_TARGET * open_rate, 1), ">=", "req/s")]


def _side_row(sc: Scenario, name: str, tally: Tally) -> list[str]:
    ttft = [s.ttft for s in tally.ok]
    total = [s.total for s in tally.ok]
    return [sc.key, name,
            f"{len(tally.ok)}" + (f" (+{len(tally.failed)} failed)" if tally.failed else ""),
            _ms2(percentile(ttft, 50)), ms(percentile(ttft, 99)),
            ms(percentile(total, 50)), ms(percentile(total, 99)),
            "-" if math.isnan(tally.rate) else f"{tally.rate:.1f}"]


def _rows(result: Result) -> list[list[str]]:
    return [_side_row(result.scenario, "none", result.direct),
            _side_row(result.scenario, "keys", result.conveyor), _added_row(result)]


def _added_row(result: Result) -> list[str]:
    added = result.added_ttft()
    added_total = [k.total - o.total for o, k in result.pairs if o.ok and k.ok]
    rate = ""
    if result.direct.rate > 0 and not math.isnan(result.conveyor.rate):
        rate = f"{100 * (result.conveyor.rate / result.direct.rate - 1):+.1f} %"
    return [result.scenario.key, "added (paired)", str(len(added)),
            _ms2(percentile(added, 50)), ms(percentile(added, 99)),
            _ms2(percentile(added_total, 50)), ms(percentile(added_total, 99)), rate]


HEADER = ["scenario", "side", "requests", "TTFT p50 ms", "TTFT p99 ms"]
HEADER += ["total p50 ms", "total p99 ms", "req/s"]


def report_scenario(result: Result) -> None:
    sc = result.scenario
    print(f"\n== {sc.key}: {sc.title} ==")
    print(markdown_table(HEADER, _rows(result)))
    added = result.added_ttft()
    low, high = median_interval(added)
    print(f"added TTFT p50 (keys - none, {len(added)} pairs): "
          f"{_ms2(percentile(added, 50))} ms, 95% interval [{_ms2(low)}, {_ms2(high)}] ms")
    for tally, name in ((result.direct, "none"), (result.conveyor, "keys")):
        short = [s for s in tally.ok if s.chars != TOKENS * len(" tok")]
        if short:
            print(f"warning: {len(short)} {name} streams had {short[0].chars} characters, "
                  f"not {TOKENS * len(' tok')}")
        if tally.failed:
            print(f"{name}: {len(tally.failed)} failed, first: {tally.failed[0].error}")
    for check in checks(result):
        print(check.line())
    print(flush=True)


def report_summary(results: list[Result]) -> None:
    rows = [row for result in results for row in _rows(result)]
    found = [check for result in results for check in checks(result)]
    print("## Auth overhead: CONVEYOR_AUTH=keys (key + tenant limits) vs. none\n")
    print(markdown_table(HEADER, rows))
    print()
    print(markdown_table(
        ["scenario", "figure", "measured", "target", "met"],
        [[c.scenario, c.label, c.measured(), c.target(), "yes" if c.met else "no"]
         for c in found]))


# Processes


def _cli(script: Path, args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([str(script), *args], capture_output=True, env=env, timeout=120,
                          cwd=repo_root())
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).decode(errors="replace").strip()[-600:]
        raise BenchError(f"`conveyor {' '.join(args[:2])}` failed:\n{detail}")
    return done.stdout.decode()


def make_key(script: Path, env: dict[str, str]) -> tuple[str, str]:
    """The tenant's limits, then a key with its own: (key id, secret)."""
    _cli(script, ["tenants", "set", TENANT, *TENANT_LIMITS], env)
    out = _cli(script, ["keys", "create", "--tenant", TENANT, "--name", "bench",
                        *KEY_LIMITS], env).strip().splitlines()
    created = next((line for line in out if line.startswith("created ")), "")
    if not created or not out[-1].startswith("cvy-"):
        raise BenchError(f"unexpected output of `conveyor keys create`: {out[:1]}")
    return created.split()[1], out[-1].strip()


def run(quick: bool, upstream_port: int, open_port: int, keyed_port: int) -> list[Result]:
    check_infra()
    for port, what in ((upstream_port, "upstream"), (open_port, "gateway (auth none)"),
                       (keyed_port, "gateway (auth keys)")):
        check_port_free(port, what)
    script = conveyor_script()
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    print(f"logs and registry in {work}", flush=True)
    models = work / "models.toml"
    models.write_text(REGISTRY)
    prefix = f"benchauth{int(time.time())}"
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    open_url, keyed_url = f"http://127.0.0.1:{open_port}", f"http://127.0.0.1:{keyed_port}"
    base = conveyor_env(topic_prefix=prefix, gateway_port=open_port, models_file=models)
    base["CONVEYOR_AUTH"] = "none"
    base.pop("CONVEYOR_AUTH_SECRET", None)
    keyed_env = {**base, "CONVEYOR_AUTH": "keys", "CONVEYOR_GATEWAY_PORT": str(keyed_port),
                 "CONVEYOR_AUTH_SECRET": secrets.token_hex(32)}
    upstream_argv = [sys.executable, "-m", "bench.upstream", "--port", str(upstream_port),
                     "--tokens", str(TOKENS), "--delay-ms", str(DELAY_MS)]
    infer_argv = [str(script), "infer", "--engine", "openai", "--upstream", upstream_url,
                  "--pool", "bench", "--capacity", "64", "--worker-id", "bench-0"]
    with ExitStack() as stack:
        upstream = stack.enter_context(running("upstream", upstream_argv, work))
        wait_http(f"{upstream_url}/v1/models", upstream, 30.0)
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
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            results = runner.run(measure(plan(quick), open_url, keyed_url, secret))
            runner.run(asyncio.sleep(1.0))  # background settles finish
            redis_url = load_settings().redis_url  # the one the gateways use
            held = runner.run(_in_flight(redis_url, prefix, key_id))
        print(f"concurrency slots still held after the run (0: every request settled): {held}")
        return results


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


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
    exit_on_sigterm()
    try:
        results = run(args.quick, args.upstream_port, args.open_port, args.keyed_port)
    except BenchError as exc:
        print(f"bench.auth_overhead: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    print()
    report_summary(results)


if __name__ == "__main__":
    main()

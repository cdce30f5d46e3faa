"""Aggregate tokens/s with SmolLM2 through Conveyor vs. llama.cpp alone.

Loads SmolLM2 twice in this process (two contexts, as ``--contexts 2``) and
starts ``conveyor up --engine llamacpp --contexts 2 --no-infra``. Then runs the
same greedy chat prompts in sequential phases, two at a time on each side:
llama.cpp alone, Conveyor, llama.cpp alone, Conveyor (never both generating at
once). The figure is completion tokens over wall time, and Conveyor's share of
llama.cpp's rate (target >= 95%).

    python -m bench.smollm2 [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import (
    BenchError,
    check_infra,
    check_port_free,
    conveyor_env,
    conveyor_script,
    exit_on_sigterm,
    running,
    wait_http,
)
from bench.llama_direct import DirectLlama, Messages, PhaseResult, smollm2_gguf
from bench.stats import Check, markdown_table

__all__ = ["main"]

MODEL = "smollm2"
TARGET_RATIO = 95.0
CONTEXTS = 2

QUESTIONS = [
    "Explain what a message queue is in two sentences.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Describe how a bicycle works to a child.",
    "Give me a short recipe for scrambled eggs.",
    "Why is the sky blue?",
    "Write a limerick about a cat who loves coffee.",
]


def prompts(count: int) -> list[Messages]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS[:count]]


async def _conveyor_one(
    client: httpx.AsyncClient, url: str, messages: Messages, max_tokens: int
) -> int:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = await client.post(url, json=body)
    if response.status_code != 200:
        raise BenchError(f"Conveyor: HTTP {response.status_code}: {response.text[:300]}")
    return int(response.json()["usage"]["completion_tokens"])


async def conveyor_phase(gateway_url: str, batch: list[Messages], max_tokens: int) -> PhaseResult:
    """All prompts through the gateway, ``CONTEXTS`` at a time."""
    url = f"{gateway_url}/v1/chat/completions"
    counts = [0] * len(batch)
    pending = list(enumerate(batch))
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as client:

        async def lane() -> None:
            while pending:
                i, messages = pending.pop(0)
                counts[i] = await _conveyor_one(client, url, messages, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(CONTEXTS)))
        wall = time.perf_counter() - start
    return PhaseResult("conveyor", sum(counts), wall, tuple(counts))


async def conveyor_warmup(gateway_url: str, timeout_s: float) -> None:
    """Until a request succeeds (consumers may still be joining), then both contexts once."""
    url = f"{gateway_url}/v1/chat/completions"
    warm = [{"role": "user", "content": "Say hi."}]
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        while True:
            try:
                await _conveyor_one(client, url, warm, 8)
                break
            except (BenchError, httpx.HTTPError, KeyError, ValueError) as exc:
                last = str(exc)[:300]
            if time.monotonic() >= deadline:
                raise BenchError(f"Conveyor: no successful request in {timeout_s:.0f} s: {last}")
            await asyncio.sleep(1.0)
        await asyncio.gather(*(_conveyor_one(client, url, warm, 8) for _ in range(CONTEXTS)))


def report(phases: list[PhaseResult]) -> None:
    rows = [
        [str(n + 1), p.side, str(p.tokens), f"{p.wall_s:.2f}", f"{p.rate:.1f}"]
        for n, p in enumerate(phases)
    ]
    print(markdown_table(["phase", "side", "tokens", "wall s", "tokens/s"], rows))
    direct = [p for p in phases if p.side == "llama.cpp"]
    conveyor = [p for p in phases if p.side == "conveyor"]
    direct_rate = sum(p.tokens for p in direct) / sum(p.wall_s for p in direct)
    table = [["llama.cpp alone (2 contexts)", f"{direct_rate:.1f}", ""]]
    if conveyor:
        conveyor_rate = sum(p.tokens for p in conveyor) / sum(p.wall_s for p in conveyor)
        share = 100 * conveyor_rate / direct_rate
        ratio = Check("smollm2", "Conveyor / llama.cpp", share, TARGET_RATIO, ">=", "%")
        verdict = "met" if ratio.met else "MISSED"
        table.append(["Conveyor (--contexts 2)", f"{conveyor_rate:.1f}", ""])
        table.append(["ratio", ratio.measured(), f"{ratio.target()} ({verdict})"])
        if direct[0].per_prompt != conveyor[0].per_prompt:
            print(
                f"note: completion tokens per prompt differ: llama.cpp {direct[0].per_prompt}, "
                f"Conveyor {conveyor[0].per_prompt} (greedy llama.cpp is not bit-reproducible "
                "once a context reuses a cached prompt prefix; each side's rate uses its own "
                "count)"
            )
    print("\n## SmolLM2: aggregate tokens/s, Conveyor vs. llama.cpp alone\n")
    print(markdown_table(["side", "tokens/s", "target"], table))


@dataclass(frozen=True)
class Plan:
    prompts: list[Messages]
    max_tokens: int
    rounds: int  # direct then Conveyor, this many times

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(prompts(4), 64, 1)
        return cls(prompts(len(QUESTIONS)), 128, 2)


def run_direct_only(plan: Plan) -> list[PhaseResult]:
    direct = DirectLlama(smollm2_gguf(), contexts=CONTEXTS)
    try:
        direct.run(prompts(CONTEXTS), 8)  # warm-up, not counted
        phases = []
        for _ in range(plan.rounds):
            phases.append(direct.run(plan.prompts, plan.max_tokens))
            print(f"llama.cpp alone: {phases[-1].rate:.1f} tokens/s", flush=True)
        return phases
    finally:
        direct.close()


def run(plan: Plan, gateway_port: int) -> list[PhaseResult]:
    check_infra()
    check_port_free(gateway_port, "gateway")
    script = conveyor_script()
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    print(f"logs in {work}", flush=True)
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    env = conveyor_env(topic_prefix=f"bench{int(time.time())}", gateway_port=gateway_port)
    argv = [str(script), "up", "--engine", "llamacpp", "--contexts", str(CONTEXTS), "--no-infra"]
    phases: list[PhaseResult] = []
    with ExitStack() as stack:
        conveyor = stack.enter_context(running("conveyor", argv, work, env))
        direct = DirectLlama(smollm2_gguf(), contexts=CONTEXTS)
        stack.callback(direct.close)
        direct.run(prompts(CONTEXTS), 8)  # warm-up, not counted
        wait_http(f"{gateway_url}/healthz", conveyor, 180.0)
        asyncio.run(conveyor_warmup(gateway_url, 120.0))
        for _ in range(plan.rounds):
            phases.append(direct.run(plan.prompts, plan.max_tokens))
            print(f"llama.cpp alone: {phases[-1].rate:.1f} tokens/s", flush=True)
            through = conveyor_phase(gateway_url, plan.prompts, plan.max_tokens)
            phases.append(asyncio.run(asyncio.wait_for(through, 600.0)))
            print(f"Conveyor:        {phases[-1].rate:.1f} tokens/s", flush=True)
    return phases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.smollm2",
        description="Aggregate tokens/s with SmolLM2: Conveyor vs. llama.cpp alone.",
    )
    parser.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens, one round")
    parser.add_argument("--gateway-port", type=int, default=8100)
    parser.add_argument(
        "--direct-only", action="store_true", help="only llama.cpp alone (no Conveyor)"
    )
    args = parser.parse_args(argv)
    exit_on_sigterm()
    plan = Plan.of(args.quick)
    try:
        phases = run_direct_only(plan) if args.direct_only else run(plan, args.gateway_port)
    except BenchError as exc:
        print(f"bench.smollm2: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    print()
    report(phases)


if __name__ == "__main__":
    main()

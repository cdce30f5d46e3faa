"""Prefix-aware routing against least-loaded, on two real llama.cpp workers.

    python -m bench.routing [--rounds 1]

Starts ``conveyor up --workers 2 --no-infra`` once least-loaded and once
prefix-aware (the order alternating over ``--rounds``) and plays on each
:data:`CONVERSATIONS` conversations of :data:`TURNS` turns, each with a long
system prompt of its own, every turn carrying the history: :data:`CLIENTS`
people at once, each switching between :data:`INTERLEAVE` conversations and
reading each answer for up to :data:`THINK_S` (docs/benchmarks/results/routing.md).
Printed: TTFT p50/p90 of every turn, of the first and of the later turns, and
tokens/s. Target: prefix-aware TTFT p50 at most half of least-loaded's,
tokens/s no lower.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.client import Sample, StreamClient, first_success, stream_completion
from bench.harness import BenchError, as_script, conveyor_up
from bench.stats import Check, markdown_table, ms, percentile

__all__ = ["main"]

MODEL = "smollm2"
CONVERSATIONS, TURNS, MAX_TOKENS = 16, 4, 24
CLIENTS = 8  # people talking at once
INTERLEAVE = 2  # conversations a client holds at once, a turn of each in turn
THINK_S = 3.0  # a pause after each answer, up to this long: turns arrive in no fixed order
CONTEXTS = 4  # each worker's
HOST_CACHE_MIB = 160  # each worker's, for the conversations its contexts moved on from
TOPICS = ["lighthouses", "beekeeping", "glaciers", "violin making", "tea", "railways",
          "coral reefs", "typography", "volcanoes", "chess openings", "bread", "comets",
          "bridges", "owls", "maps", "clocks"]
QUESTIONS = ["Give me one surprising fact.", "Why does that matter?",
             "Say it again in fewer words.", "What should I read next?",
             "Name a common mistake.", "Summarise our talk."]


def system_prompt(topic: str, phase: str) -> str:
    """About 600 tokens of instructions, different for every conversation and phase."""
    rules = " ".join(
        f"Rule {i} for the {topic} desk ({phase}): keep answer {i} short, name sources "
        f"when you can, and never repeat point {i} twice."
        for i in range(1, 23))
    return f"You are a patient guide to {topic}. {rules}"


@dataclass
class Turn:
    ttft_s: float
    tokens: int
    first: bool  # the conversation's first turn: nothing cached anywhere yet


@dataclass
class Phase:
    name: str
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)

    def later_ttfts(self) -> list[float]:
        return [t.ttft_s for t in self.turns if not t.first]

    def rate(self) -> float:
        return sum(t.tokens for t in self.turns) / self.wall_s if self.wall_s else 0.0


async def ask(client: StreamClient, url: str, messages: list[dict[str, str]],
              max_tokens: int = MAX_TOKENS) -> Sample:
    """One streamed chat turn, timed (a failure in the Sample's ``error``)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    return await stream_completion(client, url, body)


async def play(gateway_url: str, phase: Phase) -> None:
    url = f"{gateway_url}/v1/chat/completions"
    pending = list(range(CONVERSATIONS))
    pause = random.Random(7)  # the same pauses in every phase
    async with StreamClient(CLIENTS + 4, timeout_s=600.0) as client:

        async def one_client() -> None:
            while pending:
                # this client's conversations, their turns played in turn
                mine = [pending.pop(0) for _ in range(min(INTERLEAVE, len(pending)))]
                talks = [[{"role": "system",
                           "content": system_prompt(TOPICS[c % len(TOPICS)], phase.name)}]
                         for c in mine]
                for t in range(TURNS):
                    for messages in talks:
                        messages.append({"role": "user",
                                         "content": QUESTIONS[t % len(QUESTIONS)]})
                        answer = await ask(client, url, messages)
                        if answer.error is not None:
                            raise BenchError(answer.error)
                        phase.turns.append(Turn(answer.ttft, answer.tokens, first=t == 0))
                        messages.append({"role": "assistant", "content": answer.text})
                        await asyncio.sleep(pause.uniform(0, THINK_S))

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
        phase.wall_s = time.perf_counter() - start


async def warm_up(gateway_url: str, timeout_s: float) -> None:
    """Until one request succeeds (the workers may still be joining)."""
    async with StreamClient(1, timeout_s=120.0) as client:
        await first_success("Conveyor", lambda: ask(
            client, f"{gateway_url}/v1/chat/completions",
            [{"role": "user", "content": "Say hi."}], 4), timeout_s)


def run_phase(name: str, prefix_aware: bool, args: argparse.Namespace) -> Phase:
    work = Path(tempfile.mkdtemp(prefix=f"conveyor-routing-{name}-"))
    up = ["--engine", "llamacpp", "--workers", "2", "--contexts", str(CONTEXTS),
          f"--host-cache-mib={HOST_CACHE_MIB}"]
    aware = {"CONVEYOR_ROUTE_PREFIX_AWARE": "true" if prefix_aware else "false"}
    phase = Phase(name)
    with conveyor_up(up, args.gateway_port, work, 240.0, prefix=f"route{name}",
                     name=f"conveyor-{name}", extra_env=aware) as (_, gateway_url, _):
        asyncio.run(warm_up(gateway_url, 180.0))
        asyncio.run(asyncio.wait_for(play(gateway_url, phase), 3600.0))
    later = phase.later_ttfts()
    print(f"{name}: {len(phase.turns)} turns in {phase.wall_s:.1f} s, "
          f"TTFT p50 {ms(percentile(later, 50))} ms of the later turns, "
          f"{phase.rate():.1f} tokens/s (logs in {work})", flush=True)
    return phase


def report(phases: list[Phase]) -> None:
    by: dict[str, Phase] = {}  # each routing's rounds together
    for phase in phases:
        into = by.setdefault(phase.name, Phase(phase.name))
        into.wall_s += phase.wall_s
        into.turns += phase.turns
    rows, p50, later_p50, rate = [], {}, {}, {}
    for name, p in by.items():
        every = [t.ttft_s for t in p.turns]
        later = p.later_ttfts()
        p50[name] = percentile(every, 50)
        later_p50[name] = percentile(later, 50)
        rate[name] = p.rate()
        rows.append([name, str(len(every)), ms(p50[name]), ms(percentile(every, 90)),
                     ms(percentile([t.ttft_s for t in p.turns if t.first], 50)),
                     ms(later_p50[name]), ms(percentile(later, 90)), f"{rate[name]:.1f}"])
    print(markdown_table(["routing", "turns", "TTFT p50 ms", "p90 ms", "first turns p50 ms",
                          "later turns p50 ms", "later p90 ms", "tokens/s"], rows))
    if {"least-loaded", "prefix-aware"} <= by.keys():
        share = 100 * p50["prefix-aware"] / p50["least-loaded"]
        later_share = 100 * later_p50["prefix-aware"] / later_p50["least-loaded"]
        speed = 100 * rate["prefix-aware"] / rate["least-loaded"]
        print()
        print(Check("routing", "prefix-aware TTFT p50, % of least-loaded's", share, 50, "<=",
                    "%").line())
        print(f"(the later turns alone: {later_share:.0f} % of least-loaded's p50)")
        print(Check("routing", "prefix-aware tokens/s, % of least-loaded's", speed, 100, ">=",
                    "%").line())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1,
                        help="least-loaded and prefix-aware this many times each, "
                             "the order alternating")
    parser.add_argument("--gateway-port", type=int, default=8100)
    args = parser.parse_args(argv)
    phases: list[Phase] = []
    with as_script("bench.routing"):
        for r in range(args.rounds):
            order = [("least-loaded", False), ("prefix-aware", True)]
            for name, aware in order if r % 2 == 0 else order[::-1]:
                phases.append(run_phase(name, aware, args))
    print()
    report(phases)


if __name__ == "__main__":
    main()

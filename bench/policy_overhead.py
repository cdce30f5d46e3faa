"""What content policies cost on Conveyor's hot path.

One Conveyor with API keys (the upstream fixture, ``conveyor layer``,
``conveyor infer --engine openai``, one gateway) and two tenants sending the
same prompt, which holds an email address and a phone number:

- ``plain``: no policy;
- ``policed``: level 1 on input and output (1,000 terms of two words each, and
  two patterns) and PII redaction of every entity with restoration, so every
  request is redacted at the gateway, checked in preprocess, checked chunk by
  chunk in postprocess and restored at the gateway.

Scenarios (``bench.compare``): ``c1-paced`` (paired TTFT difference,
policed - plain) and ``c32-unpaced`` (each side's rate). Targets (the issue
of record): L1 + PII add under 1 ms to TTFT p50 at concurrency 1 and cost
under 5 % of the unpaced c=32 rate. Level 2 (the classifier) is not in the
policed side; its cost a request is printed with the others below.

Before the run, each check's own CPU cost on this prompt is timed in process
(``check costs``), which says where the added time goes.

    python -m bench.policy_overhead [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import time
import timeit
from collections.abc import Callable
from pathlib import Path

from bench import compare
from bench.client import make_client
from bench.compare import (
    Comparison,
    CpuReader,
    first_success,
    loop_factory,
    paired_checks,
    plan,
    report_main,
    staged,
)
from bench.harness import BenchError, conveyor_env, run_cli, running, wait_http
from bench.profile import cpu_reader
from bench.scenarios import TOKENS, Result, Scenario, Side
from conveyor.policy.classifier import classifier
from conveyor.policy.pii import FindMemo, Redactor
from conveyor.policy.restore import Restorer
from conveyor.policy.rules import parse_policy
from conveyor.policy.safety import StreamScanner, TermList

__all__ = ["main", "POLICY", "PROMPT"]

PROMPT = ("Write one short sentence about conveyor belts for jane.doe@example.com "
          "(call +1 415 555 0134 if unsure).")
TTFT_TARGET_MS = 1.0
RATE_TARGET = 0.95


def varied_prompts() -> Callable[[], str]:
    """Each call, the prompt with an address and a phone number no earlier call had
    (80,000 of each): no text repeats, so redaction searches every one."""
    count = itertools.count()

    def prompt() -> str:
        n = next(count)
        return (f"Write one short sentence about conveyor belts for user{n}@example.com "
                f"(call +1 415 {200 + n % 800:03d} 01{n // 800 % 100:02d} if unsure).")
    return prompt


def policy_text(terms: int = 1000) -> str:
    words = [f"zq{i:04d} term{i:04d}" for i in range(terms)]
    quoted = ", ".join(f'"{w}"' for w in words)
    return (f"[safety]\nblocked = {{ custom = [{quoted}] }}\n"
            "patterns = { secrets = ['\\bsk-[a-z0-9]{20,}\\b', '\\bAKIA[0-9A-Z]{16}\\b'] }\n"
            '[pii]\nredact = ["email", "phone", "card", "iban", "ip"]\nrestore = true\n')


POLICY = policy_text()


def check_costs() -> dict[str, float]:
    """Microseconds a request of this prompt spends in each check, in process."""
    doc = parse_policy(POLICY)
    terms = TermList(doc.blocked, doc.patterns)
    answer = ["".join(f" word{i}" for i in range(j, j + 1)) for j in range(TOKENS)]

    entities = ("email", "phone", "card", "iban", "ip")
    memo = FindMemo()

    def redact() -> None:
        Redactor(entities).redact(PROMPT)

    def redact_seen() -> None:
        Redactor(entities, memo=memo).redact(PROMPT)

    def stream_check() -> None:
        scanner = StreamScanner(terms)
        for piece in answer:
            scanner.feed(piece)
        scanner.flush()

    def restore() -> None:
        restorer = Restorer({"<EMAIL_1>": "jane.doe@example.com"})
        for piece in answer:
            restorer.feed(piece)
        restorer.flush()

    model = classifier()  # loaded before it is timed (about 1 s, once a process)
    runs = 200
    return {name: 1e6 * min(timeit.repeat(fn, number=runs, repeat=3)) / runs
            for name, fn in (("redact the prompt (gateway)", redact),
                             ("redact it again (gateway, the memo of texts)", redact_seen),
                             ("check the input (preprocess)", lambda: terms.first(PROMPT)),
                             ("check 32 streamed pieces (postprocess)", stream_check),
                             ("restore 32 pieces (gateway)", restore),
                             ("level 2: classify the prompt (preprocess)",
                              lambda: model.score(PROMPT)))}


POLICIES = Comparison("plain", "policed", "Policy overhead: L1 lists (1,000 terms, 2 patterns) "
                      "+ PII redaction and restoration vs. no policy",
                      paired_checks("plain", "policed", TTFT_TARGET_MS, RATE_TARGET), fine=True)


def _key(script: Path, env: dict[str, str], tenant: str) -> str:
    out = run_cli(script, ["keys", "create", "--tenant", tenant, "--name", "bench"], env)
    secret = out.strip().splitlines()[-1].strip()
    if not secret.startswith("cvy-"):
        raise BenchError(f"unexpected output of `conveyor keys create`: {out[:200]}")
    return secret


async def measure(scenarios: list[Scenario], url: str, plain_key: str,
                  policed_key: str, cpu: CpuReader | None = None,
                  vary: bool = False) -> list[Result]:
    async with make_client() as plain_client, make_client() as policed_client:
        plain_client.headers["Authorization"] = f"Bearer {plain_key}"
        policed_client.headers["Authorization"] = f"Bearer {policed_key}"
        models = {True: "bench-paced", False: "bench-unpaced"}
        plain = Side("plain", f"{url}/v1/completions", models, plain_client,
                     varied_prompts() if vary else PROMPT)
        policed = Side("policed", f"{url}/v1/completions", models, policed_client,
                       varied_prompts() if vary else PROMPT)
        await first_success(plain, 90.0)
        await first_success(policed, 90.0)
        return await compare.measure(scenarios, plain, policed, POLICIES, cpu=cpu)


def run(quick: bool, upstream_port: int, gateway_port: int, control: bool = False,
        rounds: int = 20, vary: bool = False) -> list[Result]:
    costs = check_costs()
    print("check costs on this prompt, in process (µs a request):")
    for name, us in costs.items():
        print(f"  {name:44} {us:8.1f}")
    with staged(upstream_port, {gateway_port: "gateway"}) as (stage, stack):
        script, work = stage.script, stage.work
        prefix = f"benchpolicy{int(time.time())}"
        url = f"http://127.0.0.1:{gateway_port}"
        env = {**conveyor_env(topic_prefix=prefix, gateway_port=gateway_port,
                              models_file=stage.models),
               "CONVEYOR_AUTH": "keys", "CONVEYOR_AUTH_SECRET": secrets.token_hex(32)}
        run_cli(script, ["topics"], env)
        plain_key, policed_key = _key(script, env, "plain"), _key(script, env, "policed")
        if control:  # an A/A run: the comparison's own noise, no policy on either side
            print("--control: no policy is set; both sides are plain tenants")
        else:
            policy = work / "policy.toml"
            policy.write_text(POLICY)
            run_cli(script, ["policies", "set", "--tenant", "policed", str(policy)], env)
        infer_argv = [str(script), "infer", "--engine", "openai", "--upstream",
                      stage.upstream_url, "--pool", "bench", "--capacity", "64",
                      "--worker-id", "bench-0"]
        layers = stack.enter_context(running("layers", [str(script), "layer"], work, env))
        infer = stack.enter_context(running("infer", infer_argv, work, env))
        gateway = stack.enter_context(running("gateway", [str(script), "gateway"], work, env))
        wait_http(f"{url}/healthz", gateway, 180.0)
        cpu = cpu_reader([p.popen.pid for p in (layers, infer, gateway)])
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(measure(plan(quick, rounds), url, plain_key, policed_key, cpu,
                                      vary))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy_overhead",
        description="What L1 lists and PII redaction add over no policy.")
    parser.add_argument("--quick", action="store_true", help="about 5x fewer requests")
    parser.add_argument("--upstream-port", type=int, default=9120)
    parser.add_argument("--gateway-port", type=int, default=8120)
    parser.add_argument("--control", action="store_true",
                        help="set no policy: both sides plain, the comparison's own noise")
    parser.add_argument("--rounds", type=int, default=20,
                        help="pairs of c=32 rounds (128 requests a round; default 20)")
    parser.add_argument("--vary", action="store_true",
                        help="a new address and phone number in every request's prompt, so "
                             "no text repeats (by default every request sends one prompt, "
                             "whose redaction the gateway's memo of texts then serves)")
    args = parser.parse_args(argv)
    if args.rounds < 4:
        parser.error("--rounds must be at least 4")
    report_main("bench.policy_overhead", POLICIES, lambda: run(
        args.quick, args.upstream_port, args.gateway_port, args.control, args.rounds,
        args.vary))


if __name__ == "__main__":
    main()

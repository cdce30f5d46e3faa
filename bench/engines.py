"""Engines side by side: the same greedy SmolLM2 chats at 1, 4, 8 and 16 streams.

    python -m bench.engines [--quick] [--levels 1,4,8,16] [--runs 1] [--batches 2]
                            [--no-vllm]

Loaded together and measured in turn at each level (never two generating at
once, the order reversed at every other level and run): (a) ``llamacpp``, 16
sequences over ``--batches`` batched contexts of one thread; where
``.venv-vllm/bin/python`` exists, a child process of it runs (b) Conveyor's
vLLM adapter, (c) vLLM alone with the same arguments and sampling, and (d) a
second (c), the control: how far (d) lands from (c) is this run's noise.
Every question is new (numbered: only the system prompt is found in a cache).
Printed: completion tokens over each level's wall time, TTFT p50 and time per
token p50. Target: (b)/(c) >= 0.95 (docs/benchmarks/results/engines.md).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from bench.client import Sample
from bench.harness import BenchError, as_script, repo_root
from bench.stats import Check, markdown_table, percentile

__all__ = ["engine_stream", "main"]

SEQUENCES = 16  # every side holds every stream of the highest level
VLLM_COPY = "vllm copy"  # (c) again: the control of the vLLM comparison
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


_ASKED = iter(range(1 << 30))  # numbers the questions: none is a repeat


def chat(question: str) -> str:
    """SmolLM2's chat template rendered for one question, as preprocess sends it."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            f"Hugging Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


@dataclass(frozen=True)
class Plan:
    levels: tuple[int, ...]
    max_tokens: int
    rounds: int  # requests per lane
    level_s: float  # no lane starts a request after this

    @classmethod
    def of(cls, quick: bool, levels: tuple[int, ...]) -> Plan:
        return cls(levels, 32, 1, 60.0) if quick else cls(levels, 64, 2, 150.0)


@dataclass(frozen=True)
class Level:
    streams: int
    tokens: int
    wall_s: float
    ttft_p50_s: float
    per_token_s: float

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


# A side streams one chat: (prompt, max_tokens) -> (text piece, tokens) pairs.
Stream = Callable[[str, int], AsyncIterator[tuple[str, int]]]


async def timed(stream: Stream, prompt: str, max_tokens: int) -> Sample:
    began = time.monotonic()
    first, tokens, chars = math.nan, 0, 0
    async for text, count in stream(prompt, max_tokens):
        if text and math.isnan(first):
            first = time.monotonic() - began
        tokens += count
        chars += len(text)
    return Sample(ttft=first, total=time.monotonic() - began, chars=chars, tokens=tokens)


async def run_level(stream: Stream, streams: int, plan: Plan) -> Level:
    prompts = [chat(f"({next(_ASKED)}) {QUESTIONS[i % len(QUESTIONS)]}")
               for i in range(streams * plan.rounds)]
    answers: list[Sample] = []
    began = time.monotonic()

    async def lane() -> None:
        while prompts and time.monotonic() - began < plan.level_s:
            answers.append(await timed(stream, prompts.pop(0), plan.max_tokens))

    await asyncio.wait_for(asyncio.gather(*(lane() for _ in range(streams))),
                           timeout=plan.level_s + 120)
    wall = time.monotonic() - began
    spans = [(a.total - a.ttft) / (a.tokens - 1) for a in answers if a.tokens > 1]
    per_token = [span for span in spans if not math.isnan(span)]
    return Level(streams, sum(a.tokens for a in answers), wall,
                 percentile([a.ttft for a in answers], 50), percentile(per_token, 50))


def engine_stream(engine: Any, kind: Literal["chat", "completion"] = "chat") -> Stream:
    """A Conveyor engine's greedy answers to prompts of ``kind``, as a side streams them."""
    from workers.infer.engines.base import GenerationRequest

    async def stream(prompt: str, max_tokens: int) -> AsyncIterator[tuple[str, int]]:
        request = GenerationRequest(request_id="bench", kind=kind, model="smollm2",
                                    max_tokens=max_tokens, temperature=0.0, prompt_text=prompt)
        async for piece in engine.generate(request):
            yield piece.text, piece.tokens

    return stream


async def measure(sides: dict[str, Stream], plan: Plan, runs: int) -> dict[str, list[Level]]:
    """Each side warmed up, then every level on each side in turn, ``runs`` times
    over, the order reversed at every other level and run so that no side always
    runs first in whatever the machine's load does; each figure the runs' median."""
    for stream in sides.values():
        await timed(stream, chat(QUESTIONS[0]), 4)
    results: dict[str, list[list[Level]]] = {name: [[] for _ in plan.levels] for name in sides}
    for run in range(runs):
        for i, streams in enumerate(plan.levels):
            order = list(sides.items())
            for name, stream in order if (i + run) % 2 == 0 else reversed(order):
                level = await run_level(stream, streams, plan)
                results[name][i].append(level)
                print(f"  {name:>15} {streams:>2} streams: {level.rate:6.1f} tok/s, TTFT p50 "
                      f"{level.ttft_p50_s * 1000:.0f} ms", flush=True)
    return {name: [median_level(runs_) for runs_ in levels] for name, levels in results.items()}


def median_level(runs: list[Level]) -> Level:
    def mid(values: list[float]) -> float:
        return percentile([v for v in values if not math.isnan(v)], 50)

    rate, wall = mid([r.rate for r in runs]), mid([r.wall_s for r in runs])
    return Level(runs[0].streams, round(rate * wall), wall, mid([r.ttft_p50_s for r in runs]),
                 mid([r.per_token_s for r in runs]))


# -- (a): llama.cpp in this process --------------------------------------------------


async def llamacpp_side(plan: Plan, batches: int, runs: int) -> dict[str, list[Level]]:
    from conveyor.registry import Registry
    from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

    spec = Registry.load(repo_root() / "conveyor/models.toml").resolve("smollm2")
    engine = LlamaCppBatchEngine.from_spec(spec, sequences=SEQUENCES, contexts=batches)
    await engine.start()
    try:
        return await measure({"llamacpp": engine_stream(engine)}, plan, runs)
    finally:
        await engine.close()


# -- (b), (c) and (d): vLLM, in a child process of .venv-vllm ---------------------------


async def vllm_sides(plan: Plan, runs: int) -> dict[str, list[Level]]:
    """Run in .venv-vllm: Conveyor's adapter and vLLM alone, both started, measured
    level by level in turn."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from conveyor.registry import Registry
    from workers.infer.engines.vllm import VllmEngine
    from workers.infer.engines.vllm_weights import prepare_in_child

    spec = Registry.load(repo_root() / "conveyor/models.toml").resolve("smollm2")
    model = await prepare_in_child(spec, None)
    adapter = VllmEngine(spec, model=model, capacity=SEQUENCES, dtype="float32",
                         kv_cache_gib=0.5)
    args = AsyncEngineArgs(model=str(model), served_model_name=[spec.name], dtype="float32",
                           max_model_len=spec.context_length, max_num_seqs=SEQUENCES,
                           enforce_eager=True, enable_prefix_caching=True,
                           kv_cache_memory_bytes=int(0.5 * (1 << 30)),
                           generation_config="vllm", disable_log_stats=False)
    counter = iter(range(1 << 30))

    def alone(llm: AsyncLLM) -> Stream:
        async def stream(prompt: str, max_tokens: int) -> AsyncIterator[tuple[str, int]]:
            params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens,
                                    output_kind=RequestOutputKind.DELTA)
            async for out in llm.generate(prompt, params, request_id=f"bench-{next(counter)}"):
                step = out.outputs[0]
                yield step.text, len(step.token_ids)

        return stream

    await adapter.start()
    llms: list[AsyncLLM] = []
    try:
        llms = [AsyncLLM.from_engine_args(args) for _ in range(2)]
        # all three up at once, each level on one after another (see measure); the
        # second copy of vLLM alone is the control: how far two identical engines
        # land apart in this run
        return await measure({"conveyor+vllm": engine_stream(adapter),
                              "vllm": alone(llms[0]), VLLM_COPY: alone(llms[1])}, plan, runs)
    finally:
        for llm in llms:
            llm.shutdown()
        await adapter.close()


def vllm_in_child(quick: bool, levels: tuple[int, ...], runs: int) -> None:
    """(b), (c) and (d) measured and reported by a child process of .venv-vllm."""
    python = repo_root() / ".venv-vllm/bin/python"
    if not python.exists():
        print("no .venv-vllm/bin/python: vLLM rows left out (bash infra/vllm.sh builds it)")
        return
    argv = [str(python), "-m", "bench.engines", "--vllm-child", f"--runs={runs}",
            "--levels", ",".join(map(str, levels)), *(["--quick"] if quick else [])]
    limit = 300 + 3 * max(1, runs) * len(levels) * (Plan.of(quick, levels).level_s + 120)
    code = subprocess.run(argv, cwd=repo_root(), timeout=limit, check=False).returncode
    if code != 0:
        raise BenchError(f"the vLLM child failed with code {code}")


# -- the report ------------------------------------------------------------------------


def report(results: dict[str, list[Level]], base: str, others: list[str]) -> None:
    """One table of every side against ``base``, and the checks of the targets: each
    of ``others`` but the control at 95 % of ``base``'s rate at least."""
    rows = []
    for i, a in enumerate(results[base]):
        row = [str(a.streams), f"{a.rate:.1f}"]
        for other in others:
            b = results[other][i]
            row += [f"{b.rate:.1f}", f"{b.rate / a.rate if a.rate else math.nan:.2f}"]
        sides = [results[n][i] for n in [base, *others]]
        row += [f"{lv.ttft_p50_s * 1000:.0f}" for lv in sides]
        rows.append(row + [f"{lv.per_token_s * 1000:.1f}" for lv in sides])
    header = ["streams", f"{base} tok/s"]
    for other in others:
        header += [f"{other} tok/s", f"{other}/{base}"]
    header += [f"{n} {what}" for what in ("TTFT p50 ms", "ms/token p50") for n in [base, *others]]
    print(markdown_table(header, rows))
    for other in others:
        for a, b in zip(results[base], results[other], strict=True):
            if other != VLLM_COPY:
                print(Check("engines", f"{other}/{base} at {a.streams} streams",
                            b.rate / a.rate * 100 if a.rate else math.nan, 95, ">=", "%").line())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one request a stream, 32 tokens")
    parser.add_argument("--levels", default="1,4,8,16", help="streams at once, comma-separated")
    parser.add_argument("--runs", type=int, default=1,
                        help="every level measured this many times; medians printed")
    parser.add_argument("--batches", type=int, default=2, help="(a)'s batched contexts")
    parser.add_argument("--no-vllm", action="store_true", help="leave (b), (c) and (d) out")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    levels = tuple(int(n) for n in args.levels.split(","))
    if max(levels) > SEQUENCES or min(levels) < 1:
        parser.error(f"levels are 1 to {SEQUENCES} streams")
    plan = Plan.of(args.quick, levels)
    with as_script("bench.engines"):
        if args.vllm_child:
            report(asyncio.run(vllm_sides(plan, max(1, args.runs))), "vllm",
                   ["conveyor+vllm", VLLM_COPY])
            return 0
        print(f"{plan.max_tokens} tokens a chat, {plan.rounds} chat(s) a stream, levels {levels}")
        if args.batches < 1:
            parser.error("--batches is 1 or more")
        report(asyncio.run(llamacpp_side(plan, args.batches, max(1, args.runs))), "llamacpp", [])
        if not args.no_vllm:
            vllm_in_child(args.quick, levels, args.runs)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

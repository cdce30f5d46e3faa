"""Structured outputs on the CPU engines: what holding an answer to a grammar
costs, and what compiling a schema costs.

For each llama.cpp engine (``llamacpp``, ``llamacpp-batch``) it loads SmolLM2
once and generates the same requests free and constrained to a JSON Schema,
alternating the two (free, constrained, constrained, free, ...) so that the
machine's drift falls on both sides. The figure is decode tokens/s over the
rounds (tokens of answers that reached their end or max_tokens, over the time
from their first token to their last: prompt evaluation is left out, as it is
the same on both sides), and the constrained side's share of the free side's
(target: at least 90 %). Then the time to compile a 50-property schema to a
grammar, the first time and cached.

    python -m bench.structured [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.registry import Registry
from schemas.records import ResponseFormat
from schemas.structured import _schema_grammar, grammar_of
from workers.infer.engines.base import Engine, GenerationRequest
from workers.infer.engines.llamacpp import LlamaCppEngine
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

__all__ = ["main"]

TARGET_SHARE = 90.0
QUESTIONS = [
    "List some big cities of Europe with their countries, as JSON.",
    "Name cities of Asia and their countries in JSON.",
    "Give me cities of America and the country of each as JSON.",
    "Which cities of Africa do you know? Answer in JSON with their countries.",
]
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["cities"],
    "properties": {"cities": {"type": "array", "minItems": 3, "maxItems": 6, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "country"],
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "maxLength": 16}}}}}}
FORMAT = ResponseFormat(type="json_schema", name="cities", schema=json.dumps(SCHEMA),
                        strict=True)


@dataclass
class Side:
    tokens: int = 0
    seconds: float = 0.0
    answers: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def _one(engine: Engine, question: str, max_tokens: int,
               fmt: ResponseFormat | None) -> tuple[int, float, str]:
    request = GenerationRequest(request_id="bench", kind="chat", model="smollm2",
                                max_tokens=max_tokens, temperature=0.0, response_format=fmt,
                                messages=({"role": "user", "content": question},))
    first = last = 0.0
    tokens, text = 0, []
    async for piece in engine.generate(request):
        now = time.perf_counter()
        first = first or now
        last = now
        tokens += piece.tokens
        text.append(piece.text)
    return max(0, tokens - 1), last - first, "".join(text)


async def _engine_rates(engine: Engine, rounds: int, max_tokens: int) -> tuple[Side, Side]:
    free, held = Side(), Side()
    await engine.start()
    try:
        await _one(engine, QUESTIONS[0], 8, FORMAT)  # warm: the grammar, the caches
        for r in range(rounds):
            order = [(free, None), (held, FORMAT)]
            for side, fmt in (order if r % 2 == 0 else order[::-1]):
                for question in QUESTIONS:
                    tokens, seconds, text = await _one(engine, question, max_tokens, fmt)
                    side.tokens += tokens
                    side.seconds += seconds
                    side.answers.append(text)
    finally:
        await engine.close()
    return free, held


def _wide_schema(n: int) -> str:
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer"}, {"type": "number"},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
    return json.dumps({"type": "object", "additionalProperties": False,
                       "required": [f"field_{i}" for i in range(n)],
                       "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}})


def compile_times(fields: int = 50, repeats: int = 20) -> tuple[float, float]:
    """Milliseconds to compile a ``fields``-property schema: first, then cached."""
    schema = _wide_schema(fields)
    _schema_grammar.cache_clear()
    started = time.perf_counter()
    grammar_of(ResponseFormat(type="json_schema", name="wide", schema=schema, strict=True))
    first = (time.perf_counter() - started) * 1000
    cached = []
    for _ in range(repeats):
        started = time.perf_counter()
        grammar_of(ResponseFormat(type="json_schema", name="wide", schema=schema, strict=True))
        cached.append((time.perf_counter() - started) * 1000)
    return first, statistics.median(cached)


def _valid(answers: list[str]) -> int:
    import jsonschema

    good = 0
    for text in answers:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            good += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return good


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structured",
                                     description="Constrained against free decoding on the "
                                                 "CPU engines, and schema compile times.")
    parser.add_argument("--quick", action="store_true", help="one round instead of two")
    args = parser.parse_args(argv)
    rounds, max_tokens = (1, 240) if args.quick else (2, 240)
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    engines: dict[str, Engine] = {
        "llamacpp": LlamaCppEngine.from_spec(spec, contexts=1),
        "llamacpp-batch": LlamaCppBatchEngine.from_spec(spec, sequences=1, contexts=1,
                                                        n_ctx=1024)}
    print(f"| engine | free tokens/s | constrained tokens/s | share (target >= "
          f"{TARGET_SHARE:.0f} %) | constrained answers valid |")
    print("|---|---|---|---|---|")
    for name, engine in engines.items():
        free, held = asyncio.run(_engine_rates(engine, rounds, max_tokens))
        share = 100 * held.rate / free.rate if free.rate else 0.0
        print(f"| {name} | {free.rate:.1f} | {held.rate:.1f} | {share:.1f} % | "
              f"{_valid(held.answers)} of {len(held.answers)} |", flush=True)
    first, cached = compile_times()
    print(f"\ncompiling a 50-property schema to a grammar: {first:.1f} ms the first time, "
          f"{cached:.3f} ms cached")


if __name__ == "__main__":
    main()

"""Structured outputs on the CPU engines: what holding an answer to a format
costs, and what compiling a schema costs.

For each llama.cpp engine (``llamacpp``, ``llamacpp-batch``) it loads SmolLM2
once and, for each format, generates the same greedy requests free and held
to the format, alternating the two (free, held, held, free, ...) so that the
machine's drift falls on both sides. The formats: ``json_object``, a JSON
Schema of 3-6 cities with bounded strings, and a list of 3-6 picks from an
enum of 20 strings and from one of 10,000 (the enum's grammar is a trie:
``--flat-enums`` compiles it as llama.cpp's compiler writes it, one
alternative per value, to show what that costs). The figure is decode
tokens/s (tokens of answers that reached their end or max_tokens, over the
time from their first token to their last: prompt evaluation is left out, as
it is the same on both sides), and the held side's share of the free side's
rate in the same rounds (target: at least 90 %). Then the time to compile a
50-property schema and the 10,000-string enum to a grammar, the first time.

    python -m bench.structured [--quick] [--engines llamacpp,llamacpp-batch]
                               [--formats json_object,cities,enum-20,enum-10000]
                               [--flat-enums]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.registry import Registry
from schemas import structured
from schemas.answer_format import grammar_of, violation
from schemas.records import ResponseFormat
from schemas.structured import _schema_grammar
from workers.infer.engines.base import Engine, GenerationRequest
from workers.infer.engines.llamacpp import LlamaCppEngine
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

__all__ = ["main"]

TARGET_SHARE = 90.0
CITY_QUESTIONS = [
    "List some big cities of Europe with their countries, as JSON.",
    "Give me cities of America and the country of each as JSON.",
]
PICK_QUESTIONS = [
    "Pick a few items from the catalog for a new customer, as JSON.",
    "Which items of the catalog go together? Answer in JSON.",
]
CITIES: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["cities"],
    "properties": {"cities": {"type": "array", "minItems": 3, "maxItems": 6, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "country"],
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "maxLength": 16}}}}}}


def picks(values: int) -> dict[str, Any]:
    """A list of 3-6 picks from an enum of ``values`` strings."""
    return {"type": "object", "additionalProperties": False, "required": ["picks"],
            "properties": {"picks": {"type": "array", "minItems": 3, "maxItems": 6,
                                     "items": {"enum": [f"item-{i:05d}"
                                                        for i in range(values)]}}}}


def _schema(name: str, schema: dict[str, Any]) -> ResponseFormat:
    return ResponseFormat(type="json_schema", name=name, schema=json.dumps(schema), strict=True)


FORMATS: dict[str, tuple[ResponseFormat, list[str]]] = {
    "json_object": (ResponseFormat(type="json_object", name="", schema="", strict=False),
                    CITY_QUESTIONS),
    "cities": (_schema("cities", CITIES), CITY_QUESTIONS),
    "enum-20": (_schema("picks", picks(20)), PICK_QUESTIONS),
    "enum-10000": (_schema("picks", picks(10_000)), PICK_QUESTIONS),
}


@dataclass
class Side:
    tokens: int = 0
    seconds: float = 0.0
    answers: list[str] = field(default_factory=list)  # those that ended (not cut at max_tokens)
    cut: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def _one(engine: Engine, question: str, max_tokens: int,
               fmt: ResponseFormat | None) -> tuple[int, float, str, bool]:
    request = GenerationRequest(request_id="bench", kind="chat", model="smollm2",
                                max_tokens=max_tokens, temperature=0.0, response_format=fmt,
                                messages=({"role": "user", "content": question},))
    first = last = 0.0
    tokens, text, ended = 0, [], False
    async for piece in engine.generate(request):
        now = time.perf_counter()
        first = first or now
        last = now
        tokens += piece.tokens
        text.append(piece.text)
        ended = piece.finish_reason == "stop"
    return max(0, tokens - 1), last - first, "".join(text), ended


async def _engine_rates(engine: Engine, formats: list[str], rounds: int,
                        max_tokens: int) -> dict[str, tuple[Side, Side]]:
    sides = {name: (Side(), Side()) for name in formats}
    await engine.start()
    try:
        for name in formats:  # warm: the grammars, the caches
            await _one(engine, FORMATS[name][1][0], 4, FORMATS[name][0])
        for r in range(rounds):
            for name in formats:
                fmt, questions = FORMATS[name]
                free, held = sides[name]
                order = [(free, None), (held, fmt)]
                for side, asked in (order if r % 2 == 0 else order[::-1]):
                    for question in questions:
                        tokens, seconds, text, ended = await _one(engine, question,
                                                                  max_tokens, asked)
                        side.tokens += tokens
                        side.seconds += seconds
                        if ended:
                            side.answers.append(text)
                        else:
                            side.cut += 1
    finally:
        await engine.close()
    return sides


def _wide_schema(n: int) -> str:
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer"}, {"type": "number"},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
    return json.dumps({"type": "object", "additionalProperties": False,
                       "required": [f"field_{i}" for i in range(n)],
                       "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}})


def compile_ms(schema: str) -> float:
    """Milliseconds to compile a schema (as JSON text) to a grammar, uncached."""
    _schema_grammar.cache_clear()
    started = time.perf_counter()
    grammar_of(ResponseFormat(type="json_schema", name="s", schema=schema, strict=True))
    return (time.perf_counter() - started) * 1000


def _valid(fmt: ResponseFormat, answers: list[str]) -> int:
    return sum(violation(fmt, text) is None for text in answers)


def _flat_enums() -> None:
    """Compile enums as llama.cpp's compiler writes them (one alternative per
    value) instead of as a trie."""
    from llama_cpp.llama_grammar import SchemaConverter

    structured._converter_class = lambda: SchemaConverter  # type: ignore[assignment]
    _schema_grammar.cache_clear()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structured",
                                     description="Held against free decoding on the CPU "
                                                 "engines, and schema compile times.")
    parser.add_argument("--quick", action="store_true", help="one round instead of two")
    parser.add_argument("--engines", default="llamacpp,llamacpp-batch")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"of {', '.join(FORMATS)}")
    parser.add_argument("--flat-enums", action="store_true",
                        help="an enum's grammar one alternative per value, not a trie")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else 2
    formats = [f for f in args.formats.split(",") if f]
    if args.flat_enums:
        _flat_enums()
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    makers: dict[str, Callable[[], Engine]] = {
        "llamacpp": lambda: LlamaCppEngine.from_spec(spec, contexts=1),
        "llamacpp-batch": lambda: LlamaCppBatchEngine.from_spec(spec, sequences=1, contexts=1,
                                                                n_ctx=1024)}
    print(f"| engine | format | free tokens/s | held tokens/s | share (target >= "
          f"{TARGET_SHARE:.0f} %) | held answers valid (of those not cut at max_tokens) |")
    print("|---|---|---|---|---|---|")
    for name in args.engines.split(","):
        sides = asyncio.run(_engine_rates(makers[name](), formats, rounds, args.max_tokens))
        for fmt_name, (free, held) in sides.items():
            share = 100 * held.rate / free.rate if free.rate else 0.0
            valid = _valid(FORMATS[fmt_name][0], held.answers)
            print(f"| {name} | {fmt_name} | {free.rate:.1f} | {held.rate:.1f} | {share:.1f} % | "
                  f"{valid} of {len(held.answers)} ({held.cut} cut) |", flush=True)
    wide = statistics.median(compile_ms(_wide_schema(50)) for _ in range(5))
    enum = compile_ms(FORMATS["enum-10000"][0]["schema"])
    print(f"\ncompiling to a grammar: a 50-property schema {wide:.1f} ms, the 10,000-string "
          f"enum {enum:.1f} ms (once per schema: the grammar is cached by its text)")


if __name__ == "__main__":
    main()

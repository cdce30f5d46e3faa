"""Routing and caching by meaning on a labelled set of prompts.

    python -m bench.meaning [--data tests/data/meaning.toml] [--redis redis://127.0.0.1:6379/0]

Routing: each labelled prompt, and each held-out one, through the route
layer's decision (workers/route/meaning.py), scored by examples and keywords,
by examples alone and by keywords alone: accuracy (a prompt of no route is
right at the default) and the decision's time. Caching: at each threshold,
the first prompt of every pair kept in the semantic cache (a Redis prefix of
its own, dropped at the end), each second one looked up: the paraphrases
answered (hit rate), the different questions answered (wrong hits), the
lookup's time. Its targets are checked last; figures:
docs/benchmarks/results/meaning.md.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

from bench.harness import as_script, drop_redis_keys, repo_root
from bench.stats import Check, check_table, markdown_table, ms, percentile
from conveyor.registry import Registry
from conveyor.settings import load_settings
from schemas.records import Generation
from workers.prompt_cache import Cached, PromptCache
from workers.route.embedder import Embedders
from workers.route.meaning import decide
from workers.route.semantic_cache import SemanticCache

__all__ = ["main"]

THRESHOLDS = (0.85, 0.88, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99)


def _toml(items: list[str]) -> str:
    return "[" + ", ".join('"' + i.replace('"', '\\"') + '"' for i in items) + "]"


def registry_of(data: dict[str, Any]) -> Registry:
    """Three aliases over the same routes: examples and keywords, examples,
    keywords (each route's model named as the route)."""
    routes = data["routes"]
    text = data["registry"] + "".join(
        f'[models."{name}"]\npool = "cpu"\ncontext_length = 2048\n' for name in routes)
    for alias, kinds in (("both", ("examples", "keywords")), ("examples", ("examples",)),
                         ("keywords", ("keywords",))):
        encoder = 'encoder = "minilm"\n' if "examples" in kinds else ""
        text += f'[models."{alias}"]\ndefault = "default"\n{encoder}'
        for name, route in routes.items():
            fields = ", ".join(f"{k} = {_toml(route[k])}" for k in kinds)
            text += f'routes.{name} = {{ model = "{name}", {fields} }}\n'
    return Registry.parse(text, "bench.meaning")


def generation(text: str) -> Generation:
    return {"kind": "chat", "model": "both", "prompt": None,  # type: ignore[typeddict-item]
            "messages": [{"role": "user", "content": text, "name": None}],
            "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 16, "stop": [],
                         "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0}}


async def routing(data: dict[str, Any], embedders: Embedders, key: str = "prompts"
                  ) -> tuple[list[list[str]], float]:
    registry = registry_of(data)
    labelled = [(group["route"] or "default", text) for group in data[key]
                for text in group["texts"]]
    rows, best = [], 0.0
    encoder = embedders.get(registry.resolve("minilm"))
    for route in data["routes"].values():  # the examples once, before the clock
        for example in route["examples"]:
            encoder.vector(example, example=True)
    for alias in ("both", "examples", "keywords"):
        spec = registry.resolve(alias)
        for _, text in labelled:  # each prompt embedded afresh, as a new one is
            encoder.forget(text)
        right, times = 0, []
        per_route: dict[str, list[int]] = {}
        for label, text in labelled:
            started = time.perf_counter()
            decision = await decide(spec, generation(text), registry, embedders)
            times.append(time.perf_counter() - started)
            ok = decision["model"] == label
            right += ok
            per_route.setdefault(label, [0, 0])[0] += ok
            per_route[label][1] += 1
        accuracy = right / len(labelled)
        best = accuracy if alias == "both" else best
        rows.append([alias, f"{accuracy:.2f}",
                     " ".join(f"{r} {ok}/{n}" for r, (ok, n) in per_route.items()),
                     ms(percentile(times, 50)), ms(percentile(times, 95))])
    return rows, best


async def caching(data: dict[str, Any], embedders: Embedders, redis_url: str
                  ) -> tuple[list[list[str]], tuple[float, float]]:
    encoder = Registry.parse(data["registry"], "bench.meaning").resolve("minilm")
    embedder = embedders.get(encoder)
    pairs = [(a, b, True) for a, b in data["cache"]["paraphrases"]] + \
        [(a, b, False) for a, b in data["cache"]["different"]]
    rows, at_default = [], (0.0, 1.0)
    for threshold in THRESHOLDS:
        settings = load_settings(topic_prefix=f"bench-meaning-{uuid.uuid4().hex[:8]}",
                                 redis_url=redis_url)
        cache, answers = SemanticCache(settings), PromptCache(settings)
        try:
            firsts = {a: f"bench:{i:040x}" for i, a in enumerate(dict.fromkeys(
                a for a, _, _ in pairs))}
            for text, key in firsts.items():
                await cache.remember("bench:g", embedder.vector(text), key, 600)
                await answers.put(key, Cached(text, 1, "stop", "m"), 600)
            hits = wrong = 0
            times = []
            for first, second, same in pairs:
                embedder.forget(second)  # embedded afresh, as a new prompt is
                started = time.perf_counter()
                vector = await asyncio.to_thread(embedder.vector, second)
                hit = await cache.nearest("bench:g", vector, threshold)
                times.append(time.perf_counter() - started)
                if hit is not None and same and hit.cached.text == first:
                    hits += 1
                elif hit is not None:
                    wrong += 1
            paraphrases = sum(1 for p in pairs if p[2])
            rate, wrong_rate = hits / paraphrases, wrong / len(pairs)
            if threshold == 0.95:
                at_default = (rate, wrong_rate)
            rows.append([f"{threshold:.2f}", f"{rate:.2f}", f"{wrong_rate:.3f} ({wrong})",
                         ms(percentile(times, 50)), ms(percentile(times, 95))])
        finally:
            await cache.close()
            await answers.close()
            drop_redis_keys(redis_url, settings.kafka.topic_prefix)
    return rows, at_default


async def run(args: argparse.Namespace, data: dict[str, Any]) -> None:
    embedders = Embedders()
    prompts = sum(len(g["texts"]) for g in data["prompts"])
    header = ["scored by", "accuracy", "right per route", "decision p50", "decision p95"]
    route_rows, routed = await routing(data, embedders)
    print(f"routing: {prompts} labelled prompts, {len(data['routes'])} routes and the default")
    print(markdown_table(header, route_rows))
    if data.get("heldout"):
        held_rows, _ = await routing(data, embedders, "heldout")
        print(f"\nrouting, held out: {sum(len(g['texts']) for g in data['heldout'])} prompts "
              "written after the scoring's constants were chosen")
        print(markdown_table(header, held_rows))
    cache_rows, cached = await caching(data, embedders, args.redis)
    print(f"\ncaching: {len(data['cache']['paraphrases'])} paraphrase pairs, "
          f"{len(data['cache']['different'])} different-question pairs")
    print(markdown_table(["threshold", "hit rate", "wrong hits / lookups", "lookup p50",
                          "lookup p95"], cache_rows))
    print()
    print(check_table([
        Check("routing", "accuracy, examples and keywords", routed * 100, 85, ">=", "%"),
        Check("caching", "paraphrases answered at 0.95", cached[0] * 100, 50, ">=", "%"),
        Check("caching", "wrong hits at 0.95", cached[1] * 100, 5, "<=", "%")]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.meaning", description=__doc__)
    parser.add_argument("--data", default=str(repo_root() / "tests" / "data" / "meaning.toml"))
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    with as_script("bench.meaning"):
        asyncio.run(run(args, tomllib.loads(Path(args.data).read_text())))


if __name__ == "__main__":
    main()

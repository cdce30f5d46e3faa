"""Which route of an alias a prompt goes to, by what it is about.

An alias that routes by meaning (``routes`` in the registry,
docs/operating/routing-by-meaning.md) scores the prompt's text against each
route: with an encoder, the route's share of a softmax over each route's
highest cosine similarity between the prompt's vector and its example
prompts' vectors, beside an abstention (:func:`confidences`); by keywords,
``k / (k + 0.5)`` for ``k`` of the route's keywords found in the prompt as
words (one keyword: 0.67, two: 0.8); a route with both takes the higher. The best route wins
(the first in the registry's order on a tie) when its score reaches the
alias's floor; below it, the alias's default answers. Scores are rounded to
four places, so a replay computes the recorded decision. Why this shape:
docs/decisions/0035-routing-by-meaning.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from functools import lru_cache

from conveyor.registry import MeaningRoute, ModelSpec, Registry
from schemas.records import Generation, MeaningDecision, MeaningScore
from topics.backoff import RateLimitedLog
from workers.route.embedder import Embedders, EncoderUnavailable

__all__ = ["ABSTAIN", "TEMPERATURE", "confidences", "decide", "keyword_score", "prompt_text"]

_problems = RateLimitedLog(logging.getLogger(__name__))

# the similarity at which a prompt is as likely about none of the routes, and
# the softmax's temperature (docs/decisions/0035-routing-by-meaning.md: chosen on
# tests/data/meaning.toml, cosines of all-MiniLM-L6-v2)
ABSTAIN = 0.2
TEMPERATURE = 0.05


def prompt_text(generation: Generation) -> str:
    """What a prompt is about: a completion's prompt, or a conversation's last
    user turn (earlier turns and the system prompt say less of what is asked
    now)."""
    if generation["kind"] == "completion":
        return generation.get("prompt") or ""
    users = [m["content"] for m in generation["messages"] if m["role"] == "user"]
    return users[-1] if users else ""


@lru_cache(maxsize=1024)
def _keyword_pattern(keyword: str) -> re.Pattern[str]:
    return re.compile(r"(?<!\w)" + r"\s+".join(map(re.escape, keyword.split())) + r"(?!\w)")


def keyword_score(text: str, keywords: tuple[str, ...]) -> float:
    """``k / (k + 0.5)`` for the ``k`` keywords found in ``text`` as whole words
    (case-insensitive; a keyword of several words matches across any spaces)."""
    lowered = text.lower()
    found = sum(1 for k in keywords if _keyword_pattern(k).search(lowered))
    return found / (found + 0.5)


def confidences(similarities: list[float | None]) -> list[float]:
    """Each route's share of a softmax over the routes' best similarities and
    an abstention at :data:`ABSTAIN` (temperature :data:`TEMPERATURE`): near 1
    for a route far more alike than the others and than the abstention, low
    for a prompt like none of them. A route without examples (None) gets 0."""
    known = [s for s in similarities if s is not None]
    top = max([ABSTAIN, *known])
    weights = [math.exp((s - top) / TEMPERATURE) if s is not None else 0.0
               for s in similarities]
    total = math.exp((ABSTAIN - top) / TEMPERATURE) + sum(weights)
    return [w / total for w in weights]


def _scores(spec: ModelSpec, text: str, registry: Registry,
            embedders: Embedders) -> list[float]:
    encoder = registry.find(spec.encoder) if spec.encoder else None
    out = [keyword_score(text, r.keywords) if r.keywords else 0.0 for r in spec.routes]
    if encoder is None or not any(r.examples for r in spec.routes):
        return out
    embedder = embedders.get(encoder)
    prompt = embedder.vector(text)
    similarities = [max(float(prompt @ embedder.vector(e, example=True)) for e in r.examples)
                    if r.examples else None for r in spec.routes]
    return [max(k, c) for k, c in zip(out, confidences(similarities), strict=True)]


async def decide(spec: ModelSpec, generation: Generation, registry: Registry,
                 embedders: Embedders) -> MeaningDecision:
    """The routed alias ``spec``'s decision for the prompt of ``generation``."""
    text = prompt_text(generation)
    embeds = bool(spec.encoder) and any(r.examples for r in spec.routes)
    if not text.strip():
        raw = [0.0] * len(spec.routes)
    elif embeds:  # a forward pass or more: off the event loop
        try:
            raw = await asyncio.to_thread(_scores, spec, text, registry, embedders)
        except EncoderUnavailable as exc:  # keywords alone, rather than no answer
            _problems.warning("encoder", "%s: %s; scoring keywords alone", spec.name, exc)
            embeds = False
            raw = [keyword_score(text, r.keywords) for r in spec.routes]
    else:
        raw = _scores(spec, text, registry, embedders)
    scores = [max(0.0, round(s, 4)) for s in raw]
    best: MeaningRoute | None = None
    top = -1.0
    for route, score in zip(spec.routes, scores, strict=True):
        if score > top:
            best, top = route, score
    chosen = best if best is not None and top >= spec.floor else None
    return MeaningDecision(
        alias=spec.name,
        method="embedding" if embeds else "keywords",
        floor=spec.floor, route=chosen.name if chosen else "",
        model=chosen.model if chosen else spec.default,
        scores=[MeaningScore(route=r.name, model=r.model, score=s)
                for r, s in zip(spec.routes, scores, strict=True)])

"""Route: resolve the request's model (or alias) in the registry to a pool (an
unknown model is a 404 ``model_not_found``), with the fallbacks that fit the
request (one with images: models that declare vision), in order, and a
canary's deployment picked by weight from a hash of the tenant
(:func:`topics.envelope.canary_key`). An alias that routes by meaning picks
its model by the prompt (workers/route/meaning.py), the decision kept in the
task's route; a policy's semantic cache answers a paraphrase here
(workers/route/semantic_cache.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from conveyor.policy.rules import Policy, PolicyBook
from conveyor.registry import ModelSpec, Registry
from conveyor.settings import Settings
from schemas.records import Envelope, Fallback, MeaningDecision, Prepared, Prompt, Route, Task
from topics.backoff import RateLimitedLog
from topics.catalog import PREPARED, ROUTED, TOKENS
from topics.envelope import canary_key, stamp
from topics.policies import PolicyFollower
from workers.layer import Layer
from workers.outputs import Output, Sender
from workers.preprocess.images import has_images
from workers.prompt_cache import cache_key, cacheable, hit_chunk
from workers.route.embedder import Embedders, EncoderUnavailable
from workers.route.meaning import decide, prompt_text
from workers.route.semantic_cache import SemanticCache, group_of

__all__ = ["RouteLayer"]

log = logging.getLogger(__name__)
_problems = RateLimitedLog(log)


class RouteLayer(Layer):
    name = "route"
    source = PREPARED
    cancellable = True  # nothing is held per request: its events are dropped

    def __init__(self, settings: Settings, registry: Registry,
                 policies: PolicyBook | None = None, cache: SemanticCache | None = None,
                 embedders: Embedders | None = None) -> None:
        """``policies``: a book kept current by the caller; without one the layer
        follows ``conveyor.policies`` itself while it runs."""
        self.settings = settings
        self.registry = registry
        self._sink = ROUTED.at(settings.kafka)
        self._follower = PolicyFollower(settings, policies)
        self.policies = self._follower.book
        self.cache = cache if cache is not None else SemanticCache(settings)
        self.embedders = embedders if embedders is not None else Embedders()

    async def start(self, sender: Sender) -> None:
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()
        await self.cache.close()

    async def handle(self, event: Prepared, record: Any) -> list[Output]:
        envelope = stamp(event["envelope"], self.name)
        asked = self.registry.resolve(event["generation"]["model"])
        meaning: MeaningDecision | None = None
        target = asked
        if asked.routes:
            meaning = await decide(asked, event["generation"], self.registry, self.embedders)
            target = self.registry.resolve(meaning["model"])
        spec = self.registry.deployment(target, canary_key(envelope))
        prompt = event["prompt"]
        # a request with images falls back only to models that read them, and is
        # never answered by meaning: its text alone does not say what it asks
        images = event["generation"]["kind"] == "chat" and has_images(
            event["generation"]["messages"])
        policy = self.policies.effective(envelope["tenant"], envelope["key_id"])
        if policy.semantic_cache and cacheable(event["generation"]) and not images:
            hit, prompt = await self._semantic(envelope, event, spec, asked, policy)
            if hit is not None:
                return [hit]
        needs = prompt["tokens"] + prompt["max_tokens"]
        fallbacks = [Fallback(model=f.name, pool=f.pool) for f in self.registry.fallbacks(spec)
                     if needs <= f.context_length and (f.vision or not images)]
        task = Task(
            envelope=envelope,
            generation=event["generation"],
            prompt=prompt,
            route=Route(model=spec.name, pool=spec.pool, worker_id="", partition=-1,
                        failed_workers=[], failure=None,
                        fallbacks=fallbacks, fallback_from="",
                        deployment_of=target.name if spec is not target else "",
                        meaning=meaning),
        )
        return [Output(self._sink, "Task", task, key=envelope["request_id"])]

    def _encoder(self, asked: ModelSpec) -> ModelSpec | None:
        """The embedding model the semantic cache compares prompts with: the
        alias's encoder, else the registry's first with local weights."""
        if asked.encoder:
            return self.registry.find(asked.encoder)
        return next((m for m in self.registry.models.values()
                     if m.kind == "embedding" and m.weights), None)

    async def _semantic(self, envelope: Envelope, event: Prepared, spec: ModelSpec,
                        asked: ModelSpec, policy: Policy) -> tuple[Output | None, Prompt]:
        """A hit's chunk (None on a miss), and the prompt the task carries: on
        a miss, naming where its answer is kept and with its vector remembered."""
        generation, prompt = event["generation"], event["prompt"]
        encoder = self._encoder(asked)
        text = prompt_text(generation)
        if encoder is None or not text.strip():
            return None, prompt
        # off the event loop: the first use loads the model, each a forward pass
        try:
            vector = await asyncio.to_thread(self.embedders.get(encoder).whole_vector, text)
        except EncoderUnavailable as exc:  # a miss, as Redis down is
            _problems.warning("encoder", "semantic cache skipped: %s", exc)
            return None, prompt
        if vector is None:  # longer than the encoder reads: its end would not count
            return None, prompt
        group = group_of(envelope["tenant"], spec.name, encoder.name, generation,
                         prompt["max_tokens"])
        hit = await self.cache.nearest(group, vector, policy.semantic_similarity)
        if hit is not None:
            log.info("request %s trace %s: answered from the semantic cache (similarity %.4f)",
                     envelope["request_id"], envelope["traceparent"], hit.similarity)
            chunk = hit_chunk(envelope, generation, prompt, hit.cached)
            return Output(TOKENS.at(self.settings.kafka), "TokenChunk", chunk,
                          key=envelope["request_id"]), prompt
        key = prompt.get("cache_key") or cache_key(
            envelope["tenant"], spec.name, prompt["fingerprint"], generation,
            prompt["max_tokens"])
        if key is None:
            return None, prompt
        ttl = prompt.get("cache_ttl_s") or policy.cache_ttl_s
        await self.cache.remember(group, vector, key, ttl)
        return None, Prompt(**{**prompt, "cache_key": key, "cache_ttl_s": ttl})

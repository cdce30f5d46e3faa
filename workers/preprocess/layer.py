"""The preprocess layer: ``conveyor.requests`` -> ``conveyor.prepared``. Validates,
normalises, safety-checks, measures and fits a request to its model's context
(workers/preprocess/normalize.py), names its prompt blocks (workers/prefix.py)
and answers prompt-cache hits (workers/prompt_cache.py); an unknown model goes
on with an estimate, for route to refuse
(docs/decisions/0023-preprocess-in-linear-time.md)."""

from __future__ import annotations

import asyncio
import logging
import sys

from aiokafka import ConsumerRecord

from conveyor.errors import InvalidRequest
from conveyor.policy.rules import Policy, PolicyBook
from conveyor.policy.safety import Match
from conveyor.registry import ModelSpec, Registry
from conveyor.settings import Settings
from schemas.openai.embeddings import too_many_inputs
from schemas.records import Envelope, Generation, Prepared, Prompt, Request
from schemas.tools import tool_messages
from topics.catalog import PREPARED, REQUESTS, TOKENS
from topics.envelope import canary_key, stamp
from topics.policies import PolicyFollower
from workers.layer import Layer
from workers.outputs import Output, Sender
from workers.policy_checks import (
    checked_input,
    classified_input,
    input_refusal,
    policy_audit,
    text_size,
)
from workers.prefix import block_hashes, tenant_salt
from workers.preprocess.embedding import (
    check_kind,
    embedding_fingerprint,
    measure_inputs,
    normalize_embedding,
)
from workers.preprocess.images import check_vision
from workers.preprocess.normalize import (
    Fit,
    check_logit_bias,
    fingerprint,
    fit_prompt,
    normalize_generation,
    trim_to_context,
)
from workers.preprocess.tokenizers import EstimateTokenizer, Tokenizer, TokenizerCache
from workers.prompt_cache import PromptCache, cache_key, hit_chunk

__all__ = ["PreprocessLayer"]

log = logging.getLogger(__name__)

# The completion budget of a model the registry does not know (route rejects it).
_UNKNOWN_MODEL_MAX_TOKENS = 256
# Above this many characters of text (a turn counted _TURN_CHARS more), fitting
# runs in a worker thread.
_INLINE_CHARS = 32_768
_TURN_CHARS = 64


class PreprocessLayer(Layer):
    name = "preprocess"
    source = REQUESTS
    cancellable = True  # nothing is held per request: its events are dropped

    def __init__(
        self, settings: Settings, registry: Registry, tokenizers: TokenizerCache | None = None,
        policies: PolicyBook | None = None, cache: PromptCache | None = None,
    ) -> None:
        """``policies``: a book kept current by the caller; without one the layer
        follows ``conveyor.policies`` itself while it runs."""
        self.settings = settings
        self.registry = registry
        self.tokenizers = tokenizers if tokenizers is not None else TokenizerCache()
        self._estimate = EstimateTokenizer()
        self._follower = PolicyFollower(settings, policies)
        self.policies = self._follower.book
        self.cache = cache if cache is not None else PromptCache(settings)
        self._sender: Sender | None = None

    async def start(self, sender: Sender) -> None:
        self._sender = sender
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()
        await self.cache.close()

    async def handle(
        self, event: Request, record: ConsumerRecord[bytes, bytes] | None
    ) -> list[Output]:
        envelope = stamp(event["envelope"], self.name)
        generation = normalize_embedding(event["generation"]) \
            if event["generation"]["kind"] == "embedding" \
            else normalize_generation(event["generation"])
        policy = self.policies.effective(envelope["tenant"], envelope["key_id"])
        blocked = await checked_input(policy.input_terms, generation)
        if blocked is None and policy.classifier is not None:
            blocked = await classified_input(policy.classifier, generation)
        if blocked is not None:
            return self._refused(envelope, generation, blocked, policy)
        spec = self.registry.find(generation["model"])
        if spec is not None:  # a canary's deployment (the one route picks) measures it
            spec = self.registry.deployment(spec, canary_key(envelope))
            check_kind(generation, spec)
            check_vision(generation, spec)
            self._check_routed_tools(generation, spec)
        if generation["kind"] == "embedding":
            return await self._embedding(envelope, generation, spec)
        blocks: list[int] = []
        if spec is None:
            tokenizer: Tokenizer = self._estimate
            # an estimate, and no context to fit: route refuses the model
            fit = self._fit(self._estimate, generation, sys.maxsize, _UNKNOWN_MODEL_MAX_TOKENS)
            model_key = generation["model"]
        else:
            tokenizer = await self.tokenizers.get(spec)
            check_logit_bias(generation, tokenizer.vocab_size)
            if tokenizer.renders and generation["kind"] == "chat":
                # tools and tool turns as the plain turns the template renders; an
                # engine that renders for itself (an upstream) gets them as they are
                generation = {**generation, "messages": tool_messages(
                    generation["messages"], generation.get("tools"))}
            salt = tenant_salt(envelope["tenant"], self.settings.prefix.cache_shared)
            if text_size(generation, _TURN_CHARS) > _INLINE_CHARS:
                fit, blocks = await asyncio.to_thread(self._measure, spec, tokenizer, generation,
                                                      salt)
            else:
                fit, blocks = self._measure(spec, tokenizer, generation, salt)
            model_key = spec.name
        if fit.dropped:
            log.info("request %s trace %s: dropped the %d oldest messages to fit %s",
                     envelope["request_id"], envelope["traceparent"], fit.dropped, model_key)
        if generation["kind"] == "chat":
            generation = {**generation, "messages": fit.messages}
        raw_prompt = generation["prompt"] if generation["kind"] == "completion" else None
        prompt = Prompt(text=fit.text, tokens=fit.tokens, exact=tokenizer.exact,
                        max_tokens=fit.max_tokens, dropped_messages=fit.dropped,
                        fingerprint=fingerprint(model_key, fit.text, fit.messages, raw_prompt),
                        prefix_blocks=blocks, cache_key="", cache_ttl_s=0)
        key = cache_key(envelope["tenant"], model_key, prompt["fingerprint"], generation,
                        fit.max_tokens) if policy.cache and spec is not None else None
        if key is not None:
            cached = await self.cache.get(key)
            if cached is not None:  # answered from the cache: no worker
                return [Output(TOKENS.at(self.settings.kafka), "TokenChunk",
                               hit_chunk(envelope, generation, prompt, cached),
                               key=envelope["request_id"])]
            prompt["cache_key"], prompt["cache_ttl_s"] = key, policy.cache_ttl_s
        prepared = Prepared(envelope=envelope, generation=generation, prompt=prompt)
        return [Output(PREPARED.at(self.settings.kafka), "Prepared", prepared,
                       key=envelope["request_id"])]

    async def _embedding(self, envelope: Envelope, generation: Generation,
                         spec: ModelSpec | None) -> list[Output]:
        """An embedding request measured with its model's tokenizer (each input
        within the model's length); nothing is generated, nothing cached."""
        ask = generation.get("embedding")
        assert ask is not None  # normalize_embedding checked it
        if spec is None:  # route refuses the model
            tokens, exact = sum(self._estimate.count(i) if isinstance(i, str) else len(i)
                                for i in ask["inputs"]), False
        else:
            refusal = too_many_inputs(len(ask["inputs"]), spec.dimensions, ask[
                "encoding_format"], self.settings.kafka.max_event_bytes) \
                if spec.dimensions else None
            if refusal is not None:  # a batch's line: the gateway refused it already
                raise refusal
            tokenizer = await self.tokenizers.get(spec)
            if text_size(generation) > _INLINE_CHARS:
                tokens = await asyncio.to_thread(measure_inputs, ask, tokenizer, spec)
            else:
                tokens = measure_inputs(ask, tokenizer, spec)
            exact = tokenizer.exact
        model_key = spec.name if spec is not None else generation["model"]
        prompt = Prompt(text=None, tokens=tokens, exact=exact, max_tokens=0,
                        dropped_messages=0, fingerprint=embedding_fingerprint(model_key, ask),
                        prefix_blocks=[], cache_key="", cache_ttl_s=0)
        prepared = Prepared(envelope=envelope, generation=generation, prompt=prompt)
        return [Output(PREPARED.at(self.settings.kafka), "Prepared", prepared,
                       key=envelope["request_id"])]

    def _check_routed_tools(self, generation: Generation, spec: ModelSpec) -> None:
        """Tools through an alias that routes by meaning only where no model it
        may pick has its prompt rendered here: the tools are written into the
        prompt for the model measured (schemas/tools.tool_messages), and which
        model answers is not known until route scores the prompt."""
        if not spec.routes or not generation.get("tools"):
            return
        picks = (spec.default, *(r.model for r in spec.routes))
        rendered = [n for n in picks if self.registry.resolve(n).tokenizer != "estimate"]
        if rendered:
            raise InvalidRequest(
                f"Tools are not taken through `{spec.name}`, which routes by meaning: its "
                f"model `{rendered[0]}` has its prompt rendered by Conveyor, with the tools "
                "written in for the model it answers with. Name that model instead.",
                param="tools")

    def _refused(self, envelope: Envelope, generation: Generation, blocked: Match,
                 policy: Policy) -> list[Output]:
        """A blocked input: the 400 for its client and the audit event."""
        log.info("request %s trace %s: input blocked by the content policy (%s)",
                 envelope["request_id"], envelope["traceparent"], blocked.category)
        audit = policy_audit(self.settings, envelope, "policy.input_blocked", blocked, policy,
                             self.name)
        refusal = input_refusal(blocked, "input" if generation["kind"] == "embedding"
                                else "messages")
        if self._sender is None:
            raise refusal
        return [*self._sender.error_outputs(envelope, refusal, generation), audit]

    def _measure(self, spec: ModelSpec, tokenizer: Tokenizer, generation: Generation,
                 salt: str) -> tuple[Fit, list[int]]:
        """The prompt fitted, and the chained hashes of its whole blocks of
        tokens for prefix-aware routing (workers/prefix.py), the chain begun
        with the tenant's ``salt``: none for a prompt shorter than one block,
        which is not tokenized again for them."""
        fit = self._fit(tokenizer, generation, spec.context_length, spec.default_max_tokens)
        size, limit = self.settings.prefix.block_tokens, self.settings.prefix.max_blocks
        if fit.text is None or fit.tokens < size:
            return fit, []
        return fit, block_hashes(tokenizer.ids(fit.text, size * limit), size, limit, salt)

    @staticmethod
    def _fit(tokenizer: Tokenizer, generation: Generation, context_length: int,
             default_max_tokens: int) -> Fit:
        requested = generation["sampling"]["max_tokens"]
        if generation["kind"] == "chat":
            return trim_to_context(generation["messages"], tokenizer, context_length,
                                   requested, default_max_tokens)
        assert generation["prompt"] is not None  # normalize_generation checked it
        return fit_prompt(generation["prompt"], tokenizer, context_length, requested,
                          default_max_tokens)

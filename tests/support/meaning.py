"""What the tests of routing and caching by meaning share: a route layer with
the semantic cache on (a policy book of its own, the packaged
all-MiniLM-L6-v2), and a prepared request for it."""

from __future__ import annotations

from conveyor.policy.rules import DEFAULT_SCOPE, PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.records import Prepared
from tests.support.schedule_tasks import full_task
from workers.route.embedder import Embedders
from workers.route.layer import RouteLayer
from workers.route.semantic_cache import SemanticCache

__all__ = ["CACHE_MODELS", "cached_route", "prepared_for"]

CACHE_MODELS = '''
[models."smollm2-135m-instruct"]
aliases = ["smollm2"]
pool = "cpu"
context_length = 2048
[models."all-minilm-l6-v2"]
kind = "embedding"
pool = "embed"
context_length = 256
tokenizer = "hf"
weights = "package:all_minilm_l6_v2"
'''


def cached_route(settings: Settings, embedders: Embedders, similarity: float = 0.95,
                 cache: SemanticCache | None = None) -> RouteLayer:
    book = PolicyBook()
    book.set(DEFAULT_SCOPE, f"[cache]\nsemantic = true\nsimilarity = {similarity}\n")
    return RouteLayer(settings, Registry.parse(CACHE_MODELS, "models.toml"), policies=book,
                      cache=cache, embedders=embedders)


def prepared_for(rid: str, text: str, tenant: str = "acme", temperature: float = 0.0
                 ) -> Prepared:
    task = full_task(rid, prompt=text)
    generation = {**task["generation"],
                  "sampling": {**task["generation"]["sampling"], "temperature": temperature}}
    return Prepared(envelope={**task["envelope"], "tenant": tenant},
                    generation=generation,  # type: ignore[typeddict-item]
                    prompt={**task["prompt"], "fingerprint": text})  # type: ignore[typeddict-item]

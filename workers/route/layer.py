"""Route: resolve the request's model (or alias) in the registry to a pool (an
unknown model is a 404 ``model_not_found``), with the fallbacks that fit the
request (one with images: models that declare vision), in order, and a
canary's deployment picked by weight from a hash of the tenant
(:func:`topics.envelope.canary_key`)."""

from __future__ import annotations

from typing import Any

from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.records import Fallback, Prepared, Route, Task
from topics.catalog import PREPARED, ROUTED
from topics.envelope import canary_key, stamp
from workers.layer import Layer
from workers.outputs import Output
from workers.preprocess.images import has_images

__all__ = ["RouteLayer"]


class RouteLayer(Layer):
    name = "route"
    source = PREPARED
    cancellable = True  # nothing is held per request: its events are dropped

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self._sink = ROUTED.at(settings.kafka)

    async def handle(self, event: Prepared, record: Any) -> list[Output]:
        envelope = stamp(event["envelope"], self.name)
        asked = self.registry.resolve(event["generation"]["model"])
        spec = self.registry.deployment(asked, canary_key(envelope))
        needs = event["prompt"]["tokens"] + event["prompt"]["max_tokens"]
        # a request with images falls back only to models that read them
        images = event["generation"]["kind"] == "chat" and has_images(
            event["generation"]["messages"])
        fallbacks = [Fallback(model=f.name, pool=f.pool) for f in self.registry.fallbacks(spec)
                     if needs <= f.context_length and (f.vision or not images)]
        task = Task(
            envelope=envelope,
            generation=event["generation"],
            prompt=event["prompt"],
            route=Route(model=spec.name, pool=spec.pool, worker_id="", partition=-1,
                        failed_workers=[], failure=None,
                        fallbacks=fallbacks, fallback_from="",
                        deployment_of=asked.name if spec is not asked else ""),
        )
        return [Output(self._sink, "Task", task, key=envelope["request_id"])]

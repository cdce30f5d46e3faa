"""Several models on one worker (``conveyor infer --models a,b,c --warm a
--model-budget-mib 600``): one engine per model, made by the worker's engine
factory. Warm models load before the worker joins its pool, lazy ones on
their first request, in a thread (a failed load fails that request with an
engine error). The budget counts each model's GGUF file (not its KV cache,
which the worker's ``--contexts`` and context length size); the least
recently used idle models are closed until a new one fits, never a busy one
(``0``: no budget). The heartbeat lists the models served and
loaded; schedule prefers workers that have a model loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from conveyor.errors import EngineError, InvalidRequest
from conveyor.registry import ModelSpec
from schemas.records import HostCache, KvCache
from workers.infer.engines.base import EmbeddingRequest, Engine, GenerationRequest, Piece

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ModelSet"]

log = logging.getLogger(__name__)

_MIB = 1 << 20


@dataclass
class _Loaded:
    engine: Engine
    cost: int  # bytes counted against the budget
    running: int = 0


class ModelSet:
    """One engine per model of ``specs``, made by ``make``; see the module."""

    def __init__(self, specs: Sequence[ModelSpec], make: Callable[[ModelSpec], Engine],
                 *, warm: Sequence[str] = (), budget_bytes: int = 0,
                 cost: Callable[[ModelSpec, Engine], int] | None = None) -> None:
        if not specs:
            raise ValueError("a model set needs a model")
        self.specs = {s.name: s for s in specs}
        self.order = [s.name for s in specs]
        unknown = [w for w in warm if w not in self.specs]
        if unknown:
            raise ValueError(f"warm models {unknown} are not among {self.order}")
        self.warm = list(warm) or self.order[:1]
        self.make = make
        self.budget = budget_bytes
        self.cost = cost or _file_cost
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()  # least recently used first
        self._lock = asyncio.Lock()  # one load (and its evictions) at a time
        self._idle = asyncio.Condition()
        # made (not loaded: an engine loads in start()) to read its flags; the
        # first load of its model uses it
        first = make(self.specs[self.warm[0]])
        self._made: dict[str, Engine] = {self.warm[0]: first}
        self.name = first.name
        self.capacity = first.capacity
        self.constrains_output = first.constrains_output
        self.decodes_tools = first.decodes_tools
        self.biases_logits = first.biases_logits
        self.reports_logprobs = first.reports_logprobs
        self.embeds = False  # a set of GGUF models generates
        self.sees_images = first.sees_images

    @property
    def served(self) -> list[str]:
        return list(self.order)

    async def embed(self, request: EmbeddingRequest) -> np.ndarray:
        raise InvalidRequest(f"The model `{request.model}` does not serve embeddings.",
                             param="model")

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def kv_state(self) -> KvCache | None:
        """The KV cache of the model used last (the one prefix routing follows)."""
        if not self._loaded:
            return None
        return next(reversed(self._loaded.values())).engine.kv_state()

    def host_cache_stats(self) -> HostCache | None:
        """What the loaded models' host caches did, together."""
        found = [stats for held in self._loaded.values()
                 if (stats := held.engine.host_cache_stats()) is not None]
        if not found:
            return None
        # every count an int: summed key by key
        return cast(HostCache, {name: sum(stats[name] for stats in found)  # type: ignore[literal-required]
                                for name in found[0]})

    def cache_tokens(self) -> int | None:
        """What the caches of the model used last hold."""
        if not self._loaded:
            return None
        return next(reversed(self._loaded.values())).engine.cache_tokens()

    async def start(self) -> None:
        for name in self.warm:
            await self._load(name)

    async def close(self) -> None:
        for loaded in list(self._loaded.values()):
            await loaded.engine.close()
        self._loaded.clear()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        name = request.model if request.model in self.specs else None
        if name is None:
            raise EngineError(f"this worker serves {', '.join(self.order)}, not "
                              f"{request.model}")
        loaded = await self._load(name)
        loaded.running += 1
        try:
            async for piece in loaded.engine.generate(request):
                yield piece
        finally:
            loaded.running -= 1
            async with self._idle:
                self._idle.notify_all()

    async def _load(self, name: str) -> _Loaded:
        """The model's engine, loaded (and the least recently used idle ones
        closed to make room) if it is not yet."""
        if name not in self._loaded:
            async with self._lock:
                if name not in self._loaded:
                    await self._start(name)
        self._loaded.move_to_end(name)
        return self._loaded[name]

    async def _start(self, name: str) -> None:
        spec = self.specs[name]
        engine = self._made.pop(name, None) or self.make(spec)
        cost = self.cost(spec, engine)
        await self._make_room(cost, name)
        began = time.monotonic()
        try:
            await engine.start()
        except Exception as exc:
            raise EngineError(f"{name} could not be loaded: {exc}") from exc
        self._loaded[name] = _Loaded(engine, cost)
        log.info("model %s loaded in %.1f s (%d MiB counted; loaded now: %s)", name,
                 time.monotonic() - began, cost // _MIB, ", ".join(self._loaded))

    async def _make_room(self, cost: int, name: str) -> None:
        """Close idle models, least recently used first, until ``cost`` fits."""
        if not self.budget:
            return
        if cost > self.budget:
            raise EngineError(f"{name} needs {cost // _MIB} MiB, more than the worker's "
                              f"model budget of {self.budget // _MIB} MiB")
        while sum(m.cost for m in self._loaded.values()) + cost > self.budget:
            idle = next((n for n, m in self._loaded.items() if m.running == 0), None)
            if idle is None:  # every loaded model is busy: wait for one to finish
                async with self._idle:
                    await self._idle.wait()
                continue
            gone = self._loaded.pop(idle)
            await gone.engine.close()
            log.info("model %s evicted to make room for %s", idle, name)


def _file_cost(spec: ModelSpec, engine: Engine) -> int:
    """The model's GGUF file."""
    return spec.gguf_path().stat().st_size if spec.gguf else 0

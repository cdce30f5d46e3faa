"""The real SmolLM2-135M GGUF on each llama.cpp engine, one context each: the
engines the structured-output and sampling tests run against alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conveyor.registry import Registry
from workers.infer.engines.base import Engine
from workers.infer.engines.llamacpp import LlamaCppEngine
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine


@pytest.fixture(scope="module", params=["llamacpp", "llamacpp-batch"])
async def llama_engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    made: Engine = (LlamaCppEngine.from_spec(spec, contexts=1) if request.param == "llamacpp"
                    else LlamaCppBatchEngine.from_spec(spec, sequences=2, contexts=1,
                                                       n_ctx=1024))
    await made.start()
    yield made
    await made.close()

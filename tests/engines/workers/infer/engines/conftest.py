"""The real SmolLM2-135M GGUF on the llama.cpp engine, two sequences in one
batched context: the engine the structured-output and sampling tests run
against."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conveyor.registry import Registry
from workers.infer.engines.base import Engine
from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine


@pytest.fixture(scope="module")
async def llama_engine() -> AsyncIterator[Engine]:
    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    made: Engine = LlamaCppBatchEngine.from_spec(spec, sequences=2, contexts=1, n_ctx=1024)
    await made.start()
    yield made
    await made.close()

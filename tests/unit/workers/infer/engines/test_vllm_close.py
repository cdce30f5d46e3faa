"""Closing the vLLM engine: the task reading the engine core's outputs is
cancelled before the core stops. vLLM's own shutdown stops the core first, and
that task, still running, then logged the dead core as a failure ("AsyncLLM
output_handler failed.", once in three probe runs of infra/vllm.sh). The real
engine runs in the vllm tier; here a stand-in with vLLM's shutdown order shows
what close() does around it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conveyor.registry import Registry
from tests.support.pipeline import TEST_MODELS
from workers.infer.engines.vllm import VllmEngine


class CoreAndHandler:
    """What close() touches of vLLM's AsyncLLM: ``output_handler``, a task on the
    engine's loop reading the core's outputs, and ``shutdown``, which stops the
    core (in vLLM, then cancels the handler from its own thread)."""

    def __init__(self) -> None:
        self.core_alive = True
        self.failures: list[str] = []
        self.output_handler = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            if not self.core_alive:  # what vLLM's handler logs as a failure
                self.failures.append("output_handler failed")
                return

    def shutdown(self) -> None:
        self.core_alive = False

    async def abort(self, request_ids: list[str]) -> None:
        return None


async def test_the_output_reader_is_cancelled_before_the_core_stops() -> None:
    spec = Registry.load(Path(TEST_MODELS)).resolve("smollm2")
    engine = VllmEngine(spec)
    llm = CoreAndHandler()
    engine._llm, engine._slots = llm, asyncio.Semaphore(1)  # type: ignore[assignment]
    await engine.close()
    await asyncio.sleep(0.02)  # what a handler still running would do meanwhile
    assert llm.output_handler.cancelled() and not llm.core_alive
    assert llm.failures == []

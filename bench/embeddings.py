"""Embeddings/s of the encoder engine alone, then through ``conveyor up`` (its
all-MiniLM-L6-v2 worker): REQUESTS requests of INPUTS sentences, 4 in flight
(docs/benchmarks/results/embeddings.md).  python -m bench.embeddings [REQUESTS INPUTS]"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from bench.harness import as_script, check_infra, conveyor_up
from conveyor.registry import Registry
from conveyor.settings import load_settings
from workers.infer.engines.base import EmbeddingRequest
from workers.infer.engines.encoder import EncoderEngine

REQUESTS, INPUTS = map(int, sys.argv[1:3]) if len(sys.argv) > 2 else (48, 16)
WORK = [[f"sentence {i} of request {r}, one of {REQUESTS}, goes through every layer"
         for i in range(INPUTS)] for r in range(REQUESTS)]


async def rate(embed: Callable[[list[str]], Awaitable[object]]) -> float:
    started = time.perf_counter()
    for i in range(0, REQUESTS, 4):
        await asyncio.gather(*(embed(batch) for batch in WORK[i:i + 4]))
    return REQUESTS * INPUTS / (time.perf_counter() - started)


async def alone() -> float:
    model = Registry.load(load_settings().process.models_file).resolve("all-minilm-l6-v2")
    engine = EncoderEngine(model, capacity=8)
    await engine.start()
    return await rate(lambda b: engine.embed(EmbeddingRequest("r", model.name, tuple(b))))


async def through(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def embed(batch: list[str]) -> None:
            body = {"model": "all-minilm-l6-v2", "input": batch, "encoding_format": "base64"}
            (await client.post("/v1/embeddings", json=body)).raise_for_status()
        while True:  # its worker loads the model after the gateway serves
            try:
                await embed(["warm"])
                break
            except httpx.HTTPStatusError:
                await asyncio.sleep(0.5)
        return await rate(embed)


if __name__ == "__main__":
    with as_script("bench.embeddings"):
        check_infra()
        direct = asyncio.run(alone())
        with conveyor_up(["--engine", "scripted"], 8130, Path(tempfile.mkdtemp()), 180.0,
                         prefix="embed") as (_, url, _env):
            piped = asyncio.run(through(url))
    print(f"{REQUESTS} x {INPUTS} inputs, 4 in flight: engine alone {direct:.0f}/s, "
          f"through Conveyor {piped:.0f}/s ({piped / direct:.0%})")

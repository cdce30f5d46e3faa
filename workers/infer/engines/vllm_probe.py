"""``python -m workers.infer.engines.vllm_probe``: the vLLM engine started, one
prompt answered greedily and printed. ``bash infra/vllm.sh`` proves an install
so. vLLM's engine core is a child process that imports the main module again,
so this runs as a module (``-m``) whose entry point is guarded by ``__name__``,
never as a script read from stdin."""

from __future__ import annotations

import asyncio
import time

from workers.infer.engines.base import GenerationRequest
from workers.infer.engines.vllm import VllmEngine

__all__ = ["main"]


async def _say(model: str, max_tokens: int) -> int:
    from conveyor.registry import Registry
    from conveyor.settings import load_settings

    models_file = load_settings().process.models_file
    spec = Registry.load(models_file).resolve(model)
    engine = VllmEngine(spec, models_file=models_file, capacity=1, max_model_len=512)
    await engine.start()
    try:
        request = GenerationRequest(request_id="probe", kind="completion", model=spec.name,
                                    max_tokens=max_tokens, temperature=0.0, prompt_text="Hello")
        began = time.monotonic()
        pieces = [piece async for piece in engine.generate(request)]
    finally:
        await engine.close()
    tokens = sum(p.tokens for p in pieces)
    print(f"vLLM generated {tokens} token(s) in {time.monotonic() - began:.2f} s after a "
          f"{engine.started_s:.1f} s start: {''.join(p.text for p in pieces)!r}")
    return 0 if tokens == max_tokens or pieces[-1].finish_reason == "stop" else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.infer.engines.vllm_probe``: start the engine, answer one
    prompt greedily, print it (``bash infra/vllm.sh`` proves the install so)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workers.infer.engines.vllm_probe",
                                     description=main.__doc__)
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args(argv)
    return asyncio.run(_say(args.model, args.max_tokens))


if __name__ == "__main__":
    raise SystemExit(main())

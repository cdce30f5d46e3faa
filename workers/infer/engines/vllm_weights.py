"""The weights the vLLM engine reads, made once from a registry model's GGUF file
(vLLM loads no GGUF): a Hugging Face directory (``config.json``,
``model.safetensors``, the tokenizer with its chat template).

    .venv-vllm/bin/python -m workers.infer.engines.vllm_weights smollm2

prints the directory, converting only when it is not there yet; the vLLM
engine runs it in a child process when started without ``--vllm-model``.
Stored in float32 (docs/decisions/0011-vllm-in-the-worker.md), keyed on the
file's content (``<cache>/<model>-<sha256, 12 hex>`` in
``CONVEYOR_MODEL_CACHE``, else ``$XDG_CACHE_HOME/conveyor/models``), written
beside the final directory and renamed into place under a lock file, with
``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import shutil
import sys
import time
from pathlib import Path

from conveyor.errors import ConveyorError
from conveyor.registry import ModelSpec, Registry, file_digest, model_cache

__all__ = ["prepare", "prepare_in_child", "weights_dir"]

_DONE = ".conveyor-converted"  # written last: the directory is whole


def weights_dir(spec: ModelSpec, cache: Path) -> Path:
    """The directory ``spec``'s converted weights live in (whether or not yet)."""
    return cache / f"{spec.name}-{file_digest(spec.source_gguf_path())}"


def prepare(spec: ModelSpec, cache: Path | None = None) -> Path:
    """``spec``'s weights for vLLM, converted from its GGUF file unless present."""
    target = weights_dir(spec, cache or model_cache())
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f"{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting it now
        if not (target / _DONE).exists():
            _convert(spec.source_gguf_path(), target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"  # this process reads local files only
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise ConveyorError(f"converting {gguf.name} needs transformers and torch: "
                            "run bash infra/vllm.sh") from exc
    staging = target.parent / f"{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # dequantized: a model that keeps its GGUF quantization cannot be saved
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    (staging / _DONE).write_text(f"{gguf}\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    print(f"converted {gguf.name} to {target} in {time.monotonic() - started:.1f} s",
          file=sys.stderr)


async def prepare_in_child(spec: ModelSpec, models_file: Path | None,
                           cache: Path | None = None) -> Path:
    """:func:`prepare` in a child process (its memory is returned when it ends);
    a model already converted is found here without one."""
    where = cache or model_cache()
    target = await asyncio.to_thread(weights_dir, spec, where)
    if (target / _DONE).exists():
        return target
    args = [sys.executable, "-m", "workers.infer.engines.vllm_weights", spec.name,
            "--cache", str(where)]
    if models_file is not None:
        args += ["--models", str(models_file)]
    child = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
    out, err = await child.communicate()
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-5:]
        raise ConveyorError(f"converting {spec.name} for vLLM failed: " + " / ".join(tail))
    return Path(out.decode().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.infer.engines.vllm_weights",
        description="Convert a registry model's GGUF file once for vLLM; print its directory.")
    parser.add_argument("model", help="a model name or alias of the registry")
    parser.add_argument("--models", type=Path, default=None,
                        help="the registry file (default: Conveyor's settings)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where converted models are kept (default: %(prog)s's notes)")
    args = parser.parse_args(argv)
    if args.models is None:
        from conveyor.settings import load_settings

        args.models = load_settings().process.models_file
    try:
        spec = Registry.load(args.models).resolve(args.model)
        print(prepare(spec, args.cache))
    except ConveyorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

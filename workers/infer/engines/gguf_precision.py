"""Make a registry model's GGUF file at another precision ahead of time.

    python -m workers.infer.engines.gguf_precision smollm2 --type f16

prints the converted file, converting only when it is not there yet. A model
whose ``precision`` is not ``source`` is converted on first use anyway
(:func:`conveyor.registry.precise_gguf`); this does it before a worker starts
(why f16: docs/decisions/0008-default-model-precision.md). It uses llama.cpp's
own converter (every worker has it; it dequantizes any source type and keeps
every metadata key) and the vLLM weights' cache, keyed on the source's sha256.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import get_args

from conveyor.errors import ConveyorError
from conveyor.registry import Precision, Registry, precise_gguf

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.infer.engines.gguf_precision",
        description="Convert a registry model's GGUF file once to another precision; "
                    "print the file.")
    parser.add_argument("model", help="a model name or alias of the registry")
    parser.add_argument("--type", choices=get_args(Precision), default=None,
                        help="the precision (default: the model's precision in the registry)")
    parser.add_argument("--models", type=Path, default=None,
                        help="the registry file (default: Conveyor's settings)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where converted files are kept (default: the model cache)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.models is None:
        from conveyor.settings import load_settings

        args.models = load_settings().process.models_file
    try:
        spec = Registry.load(args.models).resolve(args.model)
        precision: Precision = args.type or spec.precision
        started = time.monotonic()
        path = precise_gguf(spec.source_gguf_path(), precision, prefix=spec.name,
                            cache=args.cache)
    except ConveyorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{spec.name} at {precision}: {path.stat().st_size / 1e9:.2f} GB "
          f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

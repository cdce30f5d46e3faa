"""Imports every module of Conveyor's product packages (those the wheel ships,
pyproject.toml's ``[tool.setuptools.packages.find]``) and fails naming each one
that does not import: run by ``infra/smoke.sh`` from the environment a runtime
install makes, where a module that needs what only an extra brings fails.

Modules of the ``gpu`` extra (vLLM, torch, NVML) may lack exactly those packages,
and only those: any other missing package is a failure.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import tomllib
import traceback
from pathlib import Path

# what only `pip install conveyor[gpu]` brings: a module may miss these, nothing else
GPU_EXTRA = {"vllm", "torch", "pynvml"}
ROOT = Path(__file__).resolve().parent.parent


def product_packages() -> list[str]:
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in found]


def main() -> int:
    failed, imported, gpu_only = [], 0, []
    for package in product_packages():
        names = [package] + [m.name for m in pkgutil.walk_packages(
            [str(ROOT / package)], prefix=f"{package}.") if not m.name.endswith(".__main__")]
        for name in names:
            try:
                importlib.import_module(name)
                imported += 1
            except ModuleNotFoundError as exc:
                if (exc.name or "").split(".")[0] in GPU_EXTRA:
                    gpu_only.append(name)
                else:
                    failed.append(f"{name}: {exc}")
            except Exception:  # any other failure to import is as bad: say which and why
                failed.append(f"{name}: {traceback.format_exc(limit=2)}")
    print(f"imports: {imported} modules imported, {len(gpu_only)} need the gpu extra "
          f"({', '.join(gpu_only) or 'none'})")
    for failure in failed:
        print(f"imports: FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

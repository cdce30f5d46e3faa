"""Imports every module of Conveyor's product packages (those the wheel ships,
pyproject.toml's ``[tool.setuptools.packages.find]``) and fails naming each one
that does not import: run by ``infra/smoke.sh`` from the environment a runtime
install makes, where a module that needs what only an extra brings fails.

An import inside a function runs only when that function does, so every
import statement of every module (at any depth) is also read from its source
and the package it names looked up in the environment: a lazy import of what
only the dev extra installs fails here, not on a user's first request.

The ``gpu`` extra's packages (vLLM, torch, NVML) may be missing, and only
those: any other missing package is a failure.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import sys
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what only `pip install conveyor[gpu]` brings: a module may miss these, nothing else
GPU_EXTRA = {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].replace("-", "_").lower()
             for r in PROJECT["project"]["optional-dependencies"]["gpu"]}


def product_packages() -> list[str]:
    found = PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in found]


def imported_packages(path: Path) -> set[str]:
    """The top-level packages a module's import statements name, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def found(name: str) -> bool:
    """Whether the environment has the package (imported already, or findable)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_packages(packages: list[str]) -> list[str]:
    """``module: package`` for each import of a package this environment lacks."""
    missing = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in sorted(imported_packages(path) - GPU_EXTRA):
                if not (name in sys.stdlib_module_names or found(name)):
                    missing.append(f"{path.relative_to(ROOT)}: {name}")
    return missing


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
    failed += [f"{where} imports a package this install lacks"
               for where in missing_packages(product_packages())]
    print(f"imports: {imported} modules imported, {len(gpu_only)} need the gpu extra "
          f"({', '.join(gpu_only) or 'none'}); every import statement's package found")
    for failure in failed:
        print(f"imports: FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

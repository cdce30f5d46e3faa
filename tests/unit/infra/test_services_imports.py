"""Which way the dev tools' imports run: the tests and the benchmarks both
start their services of their own from infra/services.py, so the test suite
imports nothing of bench/ (but the tests of a benchmark itself, in
tests/unit/bench/ and, those that need the broker, tests/kafka/bench/), and
infra/ imports neither of them (nor anything of Conveyor's product: it drives
scripts and processes)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = {"cli", "conveyor", "schemas", "topics", "workers", "gateway"}


def _tops(path: Path) -> set[str]:
    """The top packages ``path`` imports (absolute imports only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_tests_import_nothing_of_the_benchmarks() -> None:
    # but the benchmarks' own tests (tests/unit/bench/: the fleet simulator's
    # model; tests/kafka/bench/: their probes of the broker)
    own = {ROOT / "tests" / tier / "bench" for tier in ("unit", "kafka")}
    wrong = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                   if "bench" in _tops(p) and not own & set(p.parents))
    assert wrong == [], "shared code belongs in infra/ (or the test itself): " + repr(wrong)


def test_infra_imports_neither_tests_nor_benchmarks_nor_the_product() -> None:
    wrong = sorted((str(p.relative_to(ROOT)), top) for p in (ROOT / "infra").rglob("*.py")
                   for top in _tops(p) & ({"tests", "bench"} | PRODUCT))
    assert wrong == []

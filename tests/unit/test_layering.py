"""What may import what (docs/architecture.md): the command line is the roof,
nothing imports it; the ground (conveyor/) imports nothing above it but the
arrows the architecture document names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "conveyor", "schemas", "topics", "workers", "gateway")
# the arrows docs/architecture.md names, each with its reason
NAMED: set[tuple[str, str]] = set()
BELOW = {"conveyor": set(), "schemas": {"conveyor"}, "topics": {"conveyor", "schemas"},
         "workers": {"conveyor", "schemas", "topics"},
         "gateway": {"conveyor", "schemas", "topics", "workers"}}


def imports(tops: tuple[str, ...] = PACKAGES,
            packages: tuple[str, ...] = PACKAGES) -> list[tuple[str, str]]:
    """(importing module, imported top package) for every import in ``packages``
    of a package in ``tops``."""
    found = []
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module \
                    and node.level == 0 else []
                found += [(module, n.split(".")[0]) for n in names
                          if n.split(".")[0] in tops]
    return found


def test_nothing_imports_the_command_line() -> None:
    assert [m for m, top in imports() if top == "cli" and not m.startswith("cli")] == []


def test_no_import_runs_up_but_the_named_ones() -> None:
    wrong = sorted({(m, top) for m, top in imports()
                    if (own := m.split(".")[0]) in BELOW and top != own
                    and top not in BELOW[own]
                    and (m.removesuffix(".__init__"), top) not in NAMED})
    assert wrong == [], "an import against docs/architecture.md's order: " + repr(wrong)


def test_kafka_client_errors_are_imported_in_topics_alone() -> None:
    """Kafka is touched in one package: elsewhere its errors come from
    topics.clients, where broker_error() says what they mean."""
    outside = []
    for package in PACKAGES:
        if package == "topics":
            continue
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if "aiokafka.errors" in text or "from aiokafka import errors" in text:
                outside.append(str(path.relative_to(ROOT)))
    assert outside == []


def test_redis_is_imported_in_its_door_alone() -> None:
    """Redis is touched in one module: elsewhere its clients (made per role),
    its client type and its errors come from conveyor.redis_clients, which
    says what the errors mean. The benchmarks and the infra scripts too."""
    outside = sorted({m for m, _ in imports(("redis",), (*PACKAGES, "bench", "infra"))
                      if m != "conveyor.redis_clients"})
    assert outside == [], "redis imported outside conveyor/redis_clients.py: " + repr(outside)


def _module_imports() -> dict[str, set[str]]:
    """Every product module -> the product modules it imports (at any depth,
    type-checking imports included: a circle of types is still a circle)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[module] = {m for m in out if m in modules and m != module}
    return graph


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = _module_imports()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == [], f"import circles: {circles}"

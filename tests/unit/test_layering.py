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


def imports(tops: tuple[str, ...] = PACKAGES) -> list[tuple[str, str]]:
    """(importing module, imported top package) for every import of ours of a
    package in ``tops``."""
    found = []
    for package in PACKAGES:
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
    says what the errors mean."""
    outside = sorted({m for m, _ in imports(("redis",)) if m != "conveyor.redis_clients"})
    assert outside == [], "redis imported outside conveyor/redis_clients.py: " + repr(outside)

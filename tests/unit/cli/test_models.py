"""``conveyor models show``: an alias that routes by meaning shows its routes,
its floor and its default, as text and as JSON."""

from __future__ import annotations

from cli.models import describe, render
from conveyor.registry import Registry

MODELS = '''
[models."coder"]
pool = "cpu"
context_length = 2048
[models."general"]
pool = "cpu"
context_length = 2048
[models."assistant"]
default = "general"
floor = 0.7
routes.coding = { model = "coder", keywords = ["python"] }
'''


def test_a_routed_alias_is_shown_with_its_routes_floor_and_default() -> None:
    registry = Registry.parse(MODELS, "models.toml")
    assert "by meaning: coding->coder, below 0.7 general" in render(registry)
    shown = describe(registry.resolve("assistant"))
    assert (shown["routes"], shown["default"], shown["floor"], shown["encoder"]) == \
        ({"coding": "coder"}, "general", 0.7, None)
    assert "routes" not in describe(registry.resolve("coder"))

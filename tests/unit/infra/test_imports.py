"""infra/imports.py, the runtime install's import check: an import at any depth
(inside a function too) of a package the environment lacks is named."""

from __future__ import annotations

from pathlib import Path

from infra.imports import GPU_EXTRA, found, imported_packages


def test_imports_at_any_depth_are_read(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom json import loads\nfrom . import sibling\n"
                      "def lazy() -> None:\n    import no_such_package_xyz.sub\n"
                      "    from another_missing import thing\n")
    names = imported_packages(module)
    assert names == {"os", "json", "no_such_package_xyz", "another_missing"}
    assert not found("no_such_package_xyz") and found("json") and found("fastavro")


def test_the_gpu_extra_is_read_from_pyproject() -> None:
    assert {"vllm", "torch", "pynvml"} <= GPU_EXTRA

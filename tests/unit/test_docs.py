"""The documentation stays true to the repository: every repository path the
docs (README.md, docs/**/*.md) and the product modules' docstrings and
comments name exists, every module a ``python -m`` in the docs runs exists,
every relative link of a page leads to a file, the README stays a front door
(250 lines at most), and the generated configuration reference lists every
setting.

A *repository path* is a token that begins with one of the repository's own
top-level directories (``workers/infer/worker.py``, ``infra/kafka.sh``,
``docs/decisions/``) or is one of its top-level files (``pyproject.toml``):
in Markdown, a code span or a word of a code block; in a docstring or a
comment, any such word, written in code or not. Tokens with a placeholder or a
wildcard (``<pool>``, ``*.avsc``, ``...``) name no one file and are passed
over; ``tests/x.py::test_y`` is checked as ``tests/x.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar, Literal

import pytest
from pydantic import BaseModel, Field, SecretStr

from conveyor.settings import Section, Settings

ROOT = Path(__file__).resolve().parents[2]
TOP_DIRS = ("cli", "conveyor", "topics", "schemas", "workers", "gateway", "infra", "bench",
            "tests", "docs", ".ci")
TOP_FILES = ("README.md", "pyproject.toml", "mkdocs.yml", ".gitignore")
PRODUCT = ("cli", "conveyor", "topics", "schemas", "workers", "gateway")
README_MAX_LINES = 250

_DIRS = "|".join(re.escape(d) for d in TOP_DIRS)
# a path-like word: a top-level directory, a slash, then path characters
_PATH = re.compile(rf"(?<![\w./~$-])((?:{_DIRS})/[\w./:<>*{{}}…$|-]*)")
_FILE = re.compile(rf"(?<![\w./~$-])({'|'.join(re.escape(f) for f in TOP_FILES)})(?![\w.-])")
_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_MODULE = re.compile(r"python -m ([\w.<>]+)")
_PLACEHOLDER = re.compile(r"[<>*{}…|$]|\.\.\.")


def _clean(token: str) -> str | None:
    """The path a token names, or None for a token that names no one file."""
    token = token.split("::", 1)[0].split("#", 1)[0]
    token = re.sub(r":\d+$", "", token).rstrip(".,;:)")
    if not token or _PLACEHOLDER.search(token):
        return None
    return token


def paths_in(text: str, *, code_only: bool) -> set[str]:
    """Repository paths named in ``text``; with ``code_only``, only inside code
    spans and code blocks (Markdown), else anywhere (docstrings, comments)."""
    if code_only:
        pieces = [m.group(2) for m in _FENCE.finditer(text)]
        rest = _FENCE.sub("", text)
        pieces += [m.group(2) for m in _SPAN.finditer(rest)]
    else:
        pieces = [text]
    found: set[str] = set()
    for piece in pieces:
        for pattern in (_PATH, _FILE):
            for match in pattern.finditer(piece):
                path = _clean(match.group(1))
                if path:
                    found.add(path)
    return found


def _exists(path: str) -> bool:
    """A file or folder; in a docstring also a module written with slashes
    (``schemas/records``) or one of its names (``workers/prefix.tenant_salt``)."""
    head, _, name = path.rpartition(".")
    named = [f"{head}.py"] if head and "/" not in name else []
    return any((ROOT / p).exists() for p in [path, f"{path}.py", *named])


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _product_files() -> Iterator[Path]:
    for package in PRODUCT:
        yield from sorted((ROOT / package).rglob("*.py"))


def _docstrings_and_comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment of a module."""
    source = path.read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno, doc)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield (tok.start[0], tok.string)


def _gen_config() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# -- what counts as a repository path --------------------------------------------------


@pytest.mark.parametrize(("text", "code_only", "expected"), [
    ("see `workers/infer/worker.py` and `infra/kafka.sh`", True,
     {"workers/infer/worker.py", "infra/kafka.sh"}),
    ("```sh\nbash infra/test.sh --fast\n```", True, {"infra/test.sh"}),
    ("the `tests/faults/test_x.py::test_y` test, `pyproject.toml`", True,
     {"tests/faults/test_x.py", "pyproject.toml"}),
    ("placeholders: `conveyor.infer.<pool>`, `schemas/avro/*.avsc`, `~/.cache/conveyor/x`",
     True, set()),
    ("workers/infer/worker.py outside code is prose in Markdown", True, set()),
    ("a docstring names workers/prefix.py, and (docs/decisions/0007-batching.md).", False,
     {"workers/prefix.py", "docs/decisions/0007-batching.md"}),
    ("``conveyor/models.toml``: the registry", False, {"conveyor/models.toml"}),
    ("not paths: conveyor.requests, .venv/bin/conveyor, a/b, /tmp/conveyor-bench", False, set()),
    ("a module and a name: schemas/records, workers/prefix.tenant_salt", False,
     {"schemas/records", "workers/prefix.tenant_salt"}),
])
def test_paths_in_finds_repository_paths_only(text: str, code_only: bool,
                                              expected: set[str]) -> None:
    assert paths_in(text, code_only=code_only) == expected


# -- the docs ------------------------------------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; at most {README_MAX_LINES}: move the rest into docs/")


def test_a_module_or_its_name_written_as_a_path_exists() -> None:
    assert _exists("workers/prefix.tenant_salt") and _exists("schemas/records")
    assert not _exists("workers/nothing.py") and not _exists("workers/prefix.py/x")


def test_every_path_the_docs_name_exists() -> None:
    missing = [f"{page.relative_to(ROOT)}: {path}"
               for page in _markdown_files()
               for path in sorted(paths_in(page.read_text(), code_only=True))
               if not _exists(path)]
    assert missing == [], "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_every_module_the_docs_run_exists() -> None:
    missing = []
    for page in _markdown_files():
        for module in _MODULE.findall(page.read_text()):
            if module.split(".")[0] not in PRODUCT + ("bench", "infra") or "<" in module:
                continue
            base = ROOT / module.replace(".", "/")
            if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
                missing.append(f"{page.relative_to(ROOT)}: python -m {module}")
    assert missing == [], "the docs run modules that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_leads_to_a_file() -> None:
    generated = _gen_config().PAGE  # made at build time, not a file in docs/
    missing = []
    for page in _markdown_files():
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            target = target.split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            resolved = (page.parent / target).resolve()
            if resolved == (ROOT / "docs" / generated).resolve():
                continue
            if not resolved.exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert missing == [], "links to files that do not exist:\n" + "\n".join(missing)


def test_every_path_a_product_module_names_exists() -> None:
    missing = [f"{path.relative_to(ROOT)}:{line}: {named}"
               for path in _product_files()
               for line, text in _docstrings_and_comments(path)
               for named in sorted(paths_in(text, code_only=False))
               if not _exists(named)]
    assert missing == [], ("docstrings and comments name paths that do not exist:\n"
                           + "\n".join(missing))


# -- the configuration reference ------------------------------------------------------------


def _fields() -> dict[str, str]:
    """Every setting by its dotted name in code, with its environment variable."""
    out: dict[str, str] = {}
    for key, section in Settings.SECTIONS.items():
        for name, info in section.model_fields.items():
            out[f"{key}.{name}"] = f"CONVEYOR_{(info.alias or name).upper()}"
    return out


def test_the_configuration_reference_lists_every_setting() -> None:
    gen = _gen_config()
    listed = {s.name: s.env for section in gen.sections(Settings) for s in section.settings}
    assert listed == _fields()
    assert len(listed) == len(Settings.FLAT)
    page = gen.render(Settings)
    missing = [env for env in listed.values() if f"`{env}`" not in page]
    assert missing == [], f"not on the configuration page: {missing}"


class _Gateway(Section):
    title = "Gateway"

    # the secret keys are hashed with; `conveyor keys` needs it too
    secret: SecretStr = Field(SecretStr(""), alias="gateway_secret")
    mode: Literal["none", "keys"] = "none"  # none: every request is tenant default
    # a task waits at most wait_s, then past queue_max a 503 at once
    wait_s: float = 5.0
    queue_max: int = 256
    port: int = 8000
    files: Path = Path(".conveyor/files")


class _Kafka(Section):
    # how long a produce waits
    linger_ms: int = 0


class _Example(BaseModel):
    gateway: _Gateway = _Gateway.model_validate({})
    kafka: _Kafka = _Kafka.model_validate({})

    SECTIONS: ClassVar[dict[str, type[Section]]] = {"gateway": _Gateway, "kafka": _Kafka}
    FLAT: ClassVar[dict[str, tuple[str, str]]] = {
        flat: (key, field) for key, cls in SECTIONS.items()
        for flat, field in cls.flat_names().items()}


def test_the_configuration_reference_reads_the_comments_of_the_code() -> None:
    gen = _gen_config()
    found = {s.name: s for section in gen.sections(_Example) for s in section.settings}
    titles = [section.title for section in gen.sections(_Example)]
    assert titles == ["Gateway", "kafka"]
    secret = found["gateway.secret"]
    assert secret.description == "the secret keys are hashed with; `conveyor keys` needs it too"
    assert (secret.env, secret.type, secret.default) == (
        "CONVEYOR_GATEWAY_SECRET", "secret", "(empty)")
    assert found["gateway.mode"].description == "none: every request is tenant default"
    assert found["gateway.mode"].type == "`none` \\| `keys`"
    # named in another field's comment, or under the same comment with no blank line
    assert found["gateway.queue_max"].description == "described with `CONVEYOR_WAIT_S`"
    assert found["gateway.port"].description == "described with `CONVEYOR_WAIT_S`"
    assert found["gateway.files"].default == "`.conveyor/files`"
    assert found["kafka.linger_ms"].env == "CONVEYOR_LINGER_MS"
    assert found["kafka.linger_ms"].description == "how long a produce waits"


def test_the_structured_output_bounds_are_documented_with_their_values() -> None:
    from schemas.structured import BOUNDS

    page = (ROOT / "docs" / "api" / "tools.md").read_text()
    for name, value, _ in BOUNDS:
        assert f"| `{name}` | {value:,} |" in page, name

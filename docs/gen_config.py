"""The configuration reference, made from the settings class at every docs build.

mkdocs loads this file as a hook (``hooks:`` in mkdocs.yml); :func:`on_files`
adds the page ``operating/configuration.md``, rendered from
:class:`conveyor.settings.Settings` itself, so the page cannot drift from the
code: a setting added to the class is on the next build's page.

A page section per settings section; for every field its environment
variable (``CONVEYOR_`` and its flat name in capitals), its type, its
default, and its description: the comment block directly above the field
plus a comment at the end of its line. A field without a comment of its own
takes the comment block that names it (``route_index_ttl_s`` in the block
above the routing fields), else that of the field on the line before it
(``metrics_host`` after ``metrics_port``).

    python docs/gen_config.py        # prints the page
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = "operating/configuration.md"


@dataclass
class Setting:
    name: str  # the attribute path, ``kafka_bootstrap`` or ``section.field``
    env: str
    type: str
    default: str
    description: str


@dataclass
class Section:
    title: str
    settings: list[Setting] = field(default_factory=list)


@dataclass
class _Comments:
    """What the source of a settings class says about its fields."""

    own: dict[str, str]  # the comment block above a field and its end-of-line comment
    above: set[str]  # the fields with a comment block above them
    blocks: list[tuple[str, str]]  # every comment block above a field: (the field, the block)
    follows: dict[str, str]  # a field -> the field on the line before it (no blank between)


def _settings_class() -> type:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module("conveyor.settings")
    module = importlib.reload(module)  # `mkdocs serve` renders again after an edit
    return module.Settings  # type: ignore[no-any-return]


def _comments(cls: type) -> _Comments:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    inline: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip() != tok.string:
            inline[tok.start[0]] = tok.string.lstrip("#").strip()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    notes = _Comments({}, set(), [], {})
    previous: tuple[str, int] | None = None
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous = None
            continue
        name = node.target.id
        above: list[str] = []
        index = node.lineno - 2  # the line above, 0-based
        while index >= 0 and lines[index].strip().startswith("#"):
            above.insert(0, lines[index].strip().lstrip("#").strip())
            index -= 1
        if above:
            notes.blocks.append((name, " ".join(above)))
            notes.above.add(name)
        text = " ".join(above + ([inline[node.lineno]] if node.lineno in inline else []))
        if text:
            notes.own[name] = text
        if previous is not None and not above and previous[1] == node.lineno - 1:
            notes.follows[name] = previous[0]
        previous = (name, node.end_lineno or node.lineno)
    return notes


def _describe(name: str, notes: _Comments) -> tuple[str, str]:
    """A field's own description, or the field whose comment block covers
    this one too: the block that names it, else the block above the run of
    fields (no blank line between) that it belongs to."""
    if name in notes.own:
        return notes.own[name], ""
    named = re.compile(rf"\b{re.escape(name)}\b")
    for owner, block in notes.blocks:
        if named.search(block):
            return "", owner
    seen: set[str] = set()
    while name in notes.follows and name not in seen:
        seen.add(name)
        name = notes.follows[name]
        if name in notes.above:
            return "", name
    return "", ""


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = " or ".join(_type(a) for a in args)
        return f"{inner} (optional)" if len(args) < len(typing.get_args(annotation)) else inner
    if isinstance(annotation, type):
        if issubclass(annotation, Path):
            return "path"
        if annotation.__name__ in ("SecretStr", "SecretBytes"):
            return "secret"
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(info: Any) -> str:
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if isinstance(value, Path):
        value = value.relative_to(ROOT) if value.is_relative_to(ROOT) else value
        value = value.as_posix()
    if isinstance(value, bool):
        value = "true" if value else "false"
    if value is None:
        return "(none)"
    if value == "":
        return "(empty)"
    return f"`{value}`"


def sections(cls: type | None = None) -> list[Section]:
    """Every setting of ``cls`` (default: :class:`conveyor.settings.Settings`),
    a page section per settings section, in the class's order."""
    cls = cls or _settings_class()
    envs = {flat: f"CONVEYOR_{flat.upper()}" for flat in cls.FLAT}  # type: ignore[attr-defined]
    out: list[Section] = []
    for key, section_cls in cls.SECTIONS.items():  # type: ignore[attr-defined]
        notes = _comments(section_cls)
        flat_of = {field: flat for flat, field in section_cls.flat_names().items()}
        section = Section(section_cls.title or key)
        for name, info in section_cls.model_fields.items():
            text, shared = _describe(name, notes)
            if shared:
                text = f"described with `{envs[flat_of[shared]]}`"
            elif not text:
                text = info.description or ""
            section.settings.append(Setting(f"{key}.{name}", envs[flat_of[name]],
                                            _type(info.annotation), _default(info),
                                            _code(text, set(flat_of.values()))))
        out.append(section)
    return out


_PATHISH = re.compile(
    r"(?<![\w./-])([\w.-]+/[\w./{}-]*[\w}]|/[\w./{}-]+|[\w-]+\.(?:py|toml|sh))(?![\w/])")


def _code(text: str, names: set[str]) -> str:
    """Settings' names (those with an underscore: ``auth`` is also a word) and
    paths in a comment, as code."""
    names = {name for name in names if "_" in name}
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    words = re.compile(rf"\b({alternatives})\b")
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # outside code spans
        piece = _PATHISH.sub(r"`\1`", pieces[i])
        chunks = piece.split("`")
        for j in range(0, len(chunks), 2):
            chunks[j] = words.sub(r"`\1`", chunks[j]) if names else chunks[j]
        pieces[i] = "`".join(chunks)
    return "`".join(pieces)


def _cell(text: str) -> str:
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def render(cls: type | None = None) -> str:
    """The page, in Markdown."""
    parts = [
        "# Configuration reference",
        "",
        "Every setting of `conveyor/settings.py`, read once from the environment when",
        "a process starts (`CONVEYOR_<NAME>`; nothing is read at import time). This",
        "page is generated from the settings class at every build of the docs",
        "(`docs/gen_config.py`), so it lists exactly what the code reads. A",
        "description is the comment above the field in the code; \"described with",
        "X\" means the field shares the comment of setting X (a comment that names",
        "it, or the comment above a run of fields with no blank line between).",
        "",
    ]
    for section in sections(cls):
        parts += [f"## {section.title}", "",
                  "| variable | in code | type | default | what it does |",
                  "|---|---|---|---|---|"]
        for s in section.settings:
            parts.append(f"| `{s.env}` | `{s.name}` | {s.type} | {_cell(s.default)} "
                         f"| {_cell(s.description)} |")
        parts.append("")
    return "\n".join(parts + _engine_options())


def _engine_options() -> list[str]:
    """The engine options (``workers/infer/engines/table.py``): flags of
    ``conveyor infer`` and ``conveyor up``, not settings."""
    from dataclasses import MISSING, fields

    from workers.infer.engines.table import ENGINES, EngineOptions

    parts = ["## Engine options", "",
             "Flags of `conveyor infer` and `conveyor up` (which hands them on to its workers),",
             "made from `EngineOptions` in `workers/infer/engines/table.py`; the engines:",
             ""]
    parts += [f"- `{e.name}`: {e.summary}" for e in ENGINES]
    parts += ["", "| flag | read by | default | what it does |", "|---|---|---|---|"]
    for f in fields(EngineOptions):
        readers = EngineOptions.readers(f.name)
        text = EngineOptions.help(f.name)
        default = "(none)" if f.default in (None, MISSING) else f"`{f.default}`"
        if isinstance(f.default, bool):
            default = "off"
        engines = "every engine" if readers is None else ", ".join(f"`{r}`" for r in readers)
        parts.append(f"| `{EngineOptions.flag(f.name)}` | {engines} | {default} "
                     f"| {_cell(_code(text, set()))} |")
    parts.append("")
    return parts


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site's files (made by the
    class of the files mkdocs hands in: nothing here imports mkdocs, which only
    the docs build installs)."""
    file_class = type(next(iter(files)))
    files.append(file_class.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())

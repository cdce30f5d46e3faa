"""Structured outputs: what an answer asked for with ``response_format`` must
be, checked at the API (:func:`check_format`: Conveyor's :data:`BOUNDS`, the
meta-schema, and a grammar llama.cpp must parse), in the engines
(:func:`json_grammar`, llama.cpp's own compiler with enums as tries) and once
answered (:func:`json_violation`, what a grammar could not hold). Why and how:
docs/decisions/0018-structured-outputs-by-grammar.md; the bounds:
docs/api/tools.md#bounds-on-a-schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from conveyor.errors import InvalidRequest
from schemas.records import ResponseFormat

__all__ = ["check_format", "format_record", "json_grammar", "json_violation", "wire_format",
           "schema_bounds_fault", "grammar_fault", "SCHEMA_PARAM", "BOUNDS", "MAX_SCHEMA_DEPTH",
           "MAX_OBJECT_PROPERTIES", "MAX_ENUM_VALUES", "MAX_ALTERNATIVES", "MAX_SCHEMA_CHARS",
           "MAX_GRAMMAR_REPEAT", "MAX_GRAMMAR_CHARS", "MAX_GRAMMAR_NESTING"]

SCHEMA_PARAM = "response_format.json_schema.schema"
# grammars kept compiled: a schema's text is the key
_GRAMMARS_KEPT = 256

# -- the bounds on a schema (each a 400 naming it; docs/api/tools.md says why) -------
# A subschema (under properties, items, anyOf, $defs, ..., or through a $ref) is one
# level below its schema, and so is a value nested in an enum, const or default.
MAX_SCHEMA_DEPTH = 64
MAX_OBJECT_PROPERTIES = 5_000  # OpenAI's bound
# over every enum; the constants of a union of constants count (it compiles alike)
MAX_ENUM_VALUES = 10_000
# llama.cpp's sampler carries every open alternative from token to token
MAX_ALTERNATIVES = 256
MAX_SCHEMA_CHARS = 120_000  # OpenAI's bound
# llama.cpp refuses a grammar of more than 1,000 nested repetitions or groups
MAX_GRAMMAR_REPEAT = 1_000
MAX_GRAMMAR_CHARS = 1_000_000  # llama.cpp parses the grammar for every request
MAX_GRAMMAR_NESTING = 1_000

BOUNDS: tuple[tuple[str, int, str], ...] = (
    ("MAX_SCHEMA_DEPTH", MAX_SCHEMA_DEPTH, "levels of nesting of a schema"),
    ("MAX_OBJECT_PROPERTIES", MAX_OBJECT_PROPERTIES, "object properties in all"),
    ("MAX_ENUM_VALUES", MAX_ENUM_VALUES, "enum values in all"),
    ("MAX_ALTERNATIVES", MAX_ALTERNATIVES,
     "alternatives of one anyOf or oneOf, optional properties of one object"),
    ("MAX_SCHEMA_CHARS", MAX_SCHEMA_CHARS,
     "characters of property names, definition names, enum and const values"),
    ("MAX_GRAMMAR_REPEAT", MAX_GRAMMAR_REPEAT,
     "the largest length or item count held while decoding (a larger one is checked after)"),
    ("MAX_GRAMMAR_CHARS", MAX_GRAMMAR_CHARS, "characters of the compiled grammar"),
    ("MAX_GRAMMAR_NESTING", MAX_GRAMMAR_NESTING, "groups nested in the compiled grammar"),
)


def check_format(fmt: ResponseFormat, param: str = SCHEMA_PARAM) -> None:
    """Raise :class:`InvalidRequest` naming ``param`` and the failing part when
    the format's schema is not a JSON Schema, passes a bound or cannot be
    compiled (checked once per schema text: a client sends the same schema
    again and again)."""
    if fmt["type"] not in ("json_object", "json_schema"):
        raise InvalidRequest(f"Unknown response_format type {fmt['type']!r}.", param=param)
    if fmt["type"] != "json_schema":
        return
    wrong = _schema_fault(fmt["schema"])
    if wrong is not None:
        raise InvalidRequest(f"Invalid schema for response_format '{fmt['name']}': {wrong}",
                             param=param)


@lru_cache(maxsize=_GRAMMARS_KEPT)
def _schema_fault(schema_text: str) -> str | None:
    """What is wrong with a schema (as JSON text), or None."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        schema = json.loads(schema_text)
    except RecursionError:
        return f"it is nested more than {MAX_SCHEMA_DEPTH} levels deep"
    except ValueError as exc:
        return f"it is not JSON: {exc}"
    wrong = schema_bounds_fault(schema)
    if wrong is not None:
        return wrong
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(the root)"
        return f"at {where}: {exc.message}"
    except RecursionError:  # a pattern's groups, nested past what the regex parser takes
        return "it is nested too deeply to check (a pattern's groups, or its schemas)"
    try:
        grammar = _schema_grammar(schema_text)
    except ValueError as exc:
        return str(exc)
    return grammar_fault(grammar)


def format_record(kind: str, name: str | None, schema: dict[str, Any] | None,
                  strict: bool | None, param: str = SCHEMA_PARAM) -> ResponseFormat | None:
    """A requested format (chat's ``response_format``, the Responses API's
    ``text.format``) as the pipeline carries it, checked; None for free text.
    A schema left out allows any JSON."""
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object", name="", schema="", strict=False)
    wrong = schema_bounds_fault(schema or {})  # before json.dumps, which recurses
    if wrong is not None:
        raise InvalidRequest(f"Invalid schema for response_format '{name or ''}': {wrong}",
                             param=param)
    fmt = ResponseFormat(type="json_schema", name=name or "", schema=json.dumps(schema or {}),
                         strict=bool(strict))
    check_format(fmt, param=param)
    return fmt


# -- the bounds ------------------------------------------------------------------------

# keywords whose value is a schema, a map of schemas, a list of schemas
_SUBSCHEMA = frozenset({"items", "additionalProperties", "not", "if", "then", "else",
                        "contains", "propertyNames", "unevaluatedItems",
                        "unevaluatedProperties", "additionalItems", "contentSchema"})
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                             "dependentSchemas"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})


@dataclass
class _Tally:
    properties: int = 0
    enum_values: int = 0
    chars: int = 0
    widest_union: int = 0
    most_optional: int = 0


def schema_bounds_fault(schema: Any) -> str | None:
    """Which of Conveyor's bounds a schema (as parsed JSON) passes, said as the
    end of a message (``it is nested 100 levels deep; at most 64 are
    allowed``), or None. It walks the schema without recursion, so a schema
    nested any depth is measured, not a RecursionError."""
    tally = _Tally()
    depth = _depth(schema, tally)
    for found, most, said, why in (
            (depth, MAX_SCHEMA_DEPTH, "it is nested {} levels deep", ""),
            (tally.properties, MAX_OBJECT_PROPERTIES, "it has {} object properties in all", ""),
            (tally.enum_values, MAX_ENUM_VALUES, "it has {} enum values in all", ""),
            (tally.widest_union, MAX_ALTERNATIVES,
             "it has a union (anyOf or oneOf) of {} alternatives",
             " (a union of constants is an enum)"),
            (tally.most_optional, MAX_ALTERNATIVES, "it has an object of {} optional properties",
             " (the others must be required)"),
            (tally.chars, MAX_SCHEMA_CHARS, "its property names, definition names, enum and "
             "const values are {} characters in all", "")):
        if found > most:
            return f"{said.format(f'{found:,}')}; at most {most:,} are allowed{why}"
    return None


def _depth(root: Any, tally: _Tally) -> int:
    """The levels of ``root`` (see :data:`MAX_SCHEMA_DEPTH`), counting into
    ``tally`` on the way: each schema once, a $ref followed to its target, a
    $ref back to a schema on the path (a recursive schema) not followed again."""
    if not isinstance(root, dict):
        return _value(root)[0]
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[dict[str, Any], list[dict[str, Any]], list[int]]] = []

    def enter(node: dict[str, Any]) -> None:
        children, extra = _schema_parts(node, root, tally)
        on_path.add(id(node))
        stack.append((node, children, [extra]))

    enter(root)
    while stack:
        node, children, best = stack[-1]
        if children:
            child = children.pop()
            if id(child) in height:
                best[0] = max(best[0], height[id(child)])
            elif id(child) not in on_path:
                enter(child)
            continue
        stack.pop()
        on_path.discard(id(node))
        height[id(node)] = best[0] + 1
        if stack:
            stack[-1][2][0] = max(stack[-1][2][0], best[0] + 1)
    return height[id(root)]


def _schema_parts(node: dict[str, Any], root: dict[str, Any],
                  tally: _Tally) -> tuple[list[dict[str, Any]], int]:
    """A schema's subschemas (its $ref's target among them) and the levels its
    values nest below it; its properties, enum values and characters tallied."""
    children: list[dict[str, Any]] = []
    extra = 0
    for key, value in node.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            subs = list(value.values())
            if key == "properties":
                tally.properties += len(value)
                required = node.get("required")
                named = {r for r in required if isinstance(r, str) and r in value} \
                    if isinstance(required, list) else set()
                tally.most_optional = max(tally.most_optional, len(value) - len(named))
            if key in ("properties", "$defs", "definitions"):
                tally.chars += sum(len(name) for name in value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            subs = value
            if key in ("anyOf", "oneOf"):
                if all(_literal_only(branch) for branch in value):  # a trie, as an enum
                    tally.enum_values += sum("const" in branch for branch in value)
                else:
                    tally.widest_union = max(tally.widest_union, len(value))
        elif key in _SUBSCHEMA:
            subs = [value]
        elif key == "$ref" and isinstance(value, str):
            subs = [_target(root, value)]
        else:  # a value (enum, const, default, a keyword Conveyor does not read)
            levels, chars = _value(value)
            extra = max(extra, levels - 1)  # the value's own list or object is no level
            if key in ("enum", "const"):
                tally.chars += chars
            if key == "enum" and isinstance(value, list):
                tally.enum_values += len(value)
            continue
        for sub in subs:
            if isinstance(sub, dict):
                children.append(sub)
            else:
                extra = max(extra, _value(sub)[0] - 1)
    return children, extra


def _literal_only(branch: Any) -> bool:
    """Whether a union's branch allows only constants (as :func:`_literal_texts`
    reads it)."""
    return (isinstance(branch, dict) and "$ref" not in branch and "anyOf" not in branch
            and "oneOf" not in branch and not isinstance(branch.get("type"), list)
            and ("const" in branch or isinstance(branch.get("enum"), list)))


def _target(root: dict[str, Any], ref: str) -> Any:
    """The schema a local ``$ref`` (``#/$defs/City``) points at, or None."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _value(value: Any) -> tuple[int, int]:
    """The levels a JSON value nests (a scalar none, a list or an object one more
    than what it holds) and the characters of its strings and keys, without
    recursion."""
    deepest = chars = 0
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level + 1)
            chars += sum(len(k) for k in item)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level + 1)
            stack.extend((v, level + 1) for v in item)
        elif isinstance(item, str):
            chars += len(item)
        else:
            chars += len(str(item))
    return deepest, chars


# -- the grammar ---------------------------------------------------------------------


def json_grammar(fmt: ResponseFormat) -> str:
    """The GBNF grammar of a JSON format (``json_object``, ``json_schema``):
    text the llama.cpp sampler takes. Raises ValueError (saying what it could
    not compile) for a schema it cannot."""
    if fmt["type"] == "json_object":
        return _json_object_grammar()
    return _schema_grammar(fmt["schema"])


@lru_cache(maxsize=1)
def _json_object_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF  # its root is an object, as OpenAI's json_object asks


@lru_cache(maxsize=_GRAMMARS_KEPT)
def _schema_grammar(schema_text: str) -> str:
    """llama.cpp's compiler closes every object to the properties it names, so
    strict and loose schemas decode alike (a loose schema's answer is the
    narrower one)."""
    converter = schema_converter()
    try:
        schema = converter.resolve_refs(json.loads(schema_text), "schema")
        converter.visit(schema, "")
        return _json_strings(str(converter.format_grammar()))
    except RecursionError:
        raise ValueError("it recurses too deeply to compile (an object of hundreds of "
                         "optional properties compiles to rules nested one in another)") from None
    except Exception as exc:  # the compiler's asserts and lookups: the schema's faults
        message = str(exc) or type(exc).__name__
        raise ValueError(message.replace("schema#", "#")) from None


def schema_converter() -> Any:
    """llama.cpp's JSON Schema to GBNF compiler, with an enum (or a union of
    constants) compiled to a trie of its values and lengths or item counts
    above :data:`MAX_GRAMMAR_REPEAT` left to the answer's check."""
    return _converter_class()(prop_order={}, allow_fetch=False, dotall=False,
                              raw_pattern=False)


@lru_cache(maxsize=1)
def _converter_class() -> type:
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):  # type: ignore[misc]
        def visit(self, schema: Any, name: str) -> str:
            texts = _literal_texts(schema) if isinstance(schema, dict) else None
            if texts is not None and len(texts) > 1:
                rule = name + "-" if name in RESERVED_NAMES else name or "root"
                return str(self._add_rule(rule, self._trie(texts, rule)))
            if isinstance(schema, dict):
                schema = _repeats_held(schema)
            return str(super().visit(schema, name))

        def _trie(self, texts: list[str], name: str) -> str:
            """The root's body; every other node of the trie a rule of its own."""
            nodes = literal_trie(texts)
            keys: dict[int, str] = {}
            body = ""
            for i in reversed(range(len(nodes))):  # children before their parents
                ends_here, branches = nodes[i]
                body = " | ".join(_gbnf_literal(chars) + ("" if child is None else
                                                          f" {keys[child]}")
                                  for chars, child in branches)
                body = f"({body})?" if ends_here else body
                if i:
                    keys[i] = str(self._add_rule(f"{name}-{i}", body))
            return body

    return Converter


def _literal_texts(schema: dict[str, Any]) -> list[str] | None:
    """The JSON texts a schema allows when it allows only constants (an enum, a
    union of constants and enums), else None; read in the compiler's own order
    of keywords ($ref, then a union, a list of types, const, enum)."""
    if "$ref" in schema:
        return None
    if "oneOf" in schema or "anyOf" in schema:
        branches = schema.get("oneOf") or schema["anyOf"]
        if not isinstance(branches, list) or not all(_literal_only(b) for b in branches):
            return None
        return [text for branch in branches for text in _literal_texts(branch) or ()]
    if isinstance(schema.get("type"), list):
        return None
    if "const" in schema:
        return [json.dumps(schema["const"])]
    if isinstance(schema.get("enum"), list):
        return [json.dumps(value) for value in schema["enum"]]
    return None


def literal_trie(texts: list[str]) -> list[tuple[bool, list[tuple[str, int | None]]]]:
    """A trie of ``texts``, its nodes root first: whether a text ends at the
    node, and its branches (the characters that follow, and the node they lead
    to, or None where they end a text). A node stands where texts part, so a
    grammar of it holds one alternative per branch of the node it stands in,
    however many texts there are. Built without recursion."""
    groups: list[tuple[list[str], int]] = [(sorted(set(texts)), 0)]
    nodes: list[tuple[bool, list[tuple[str, int | None]]]] = []
    i = 0
    while i < len(groups):
        group, at = groups[i]
        ends_here = len(group[0]) == at  # sorted: a text that ends here comes first
        rest = group[1:] if ends_here else group
        branches: list[tuple[str, int | None]] = []
        start = 0
        while start < len(rest):
            stop = start + 1
            while stop < len(rest) and rest[stop][at] == rest[start][at]:
                stop += 1
            first, last = rest[start], rest[stop - 1]
            if stop - start == 1:
                branches.append((first[at:], None))
            else:  # sorted: the first and the last share the least
                shared = at + 1
                while shared < min(len(first), len(last)) and first[shared] == last[shared]:
                    shared += 1
                groups.append((rest[start:stop], shared))
                branches.append((first[at:shared], len(groups) - 1))
            start = stop
        nodes.append((ends_here, branches))
        i += 1
    return nodes


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal of ``text`` (JSON texts are ASCII: only the quote
    and the backslash need escaping)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _repeats_held(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as its grammar holds it: lengths and item counts above
    :data:`MAX_GRAMMAR_REPEAT` left out (the answer is checked against them)."""
    over = [k for k in ("minLength", "maxLength", "minItems", "maxItems")
            if isinstance(schema.get(k), int) and schema[k] > MAX_GRAMMAR_REPEAT]
    return {k: v for k, v in schema.items() if k not in over} if over else schema


def _json_strings(grammar: str) -> str:
    """The compiler's string characters take raw control characters (a newline
    inside a string), which JSON does not: they may only be escaped."""
    lines = grammar.splitlines()
    for i, rule in enumerate(lines):
        if rule.startswith("char ::= ") and '[^"\\\\]' in rule:
            lines[i] = rule.replace('[^"\\\\]', '[^"\\\\\\x7F\\x00-\\x1F]', 1)
    return "\n".join(lines) + "\n"


# string literals and character classes, whose parentheses are not groups
_GBNF_ATOMS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')


def grammar_fault(grammar: str) -> str | None:
    """What keeps llama.cpp from decoding with a compiled grammar, or None: its
    size, its nesting (measured before llama.cpp's parser, which recurses into
    every group, sees it), or llama.cpp's own refusal."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        return (f"its grammar is {len(grammar):,} characters; at most "
                f"{MAX_GRAMMAR_CHARS:,} are allowed")
    nesting = deepest = 0
    for bracket in re.findall(r"[()]", _GBNF_ATOMS.sub("", grammar)):
        nesting += 1 if bracket == "(" else -1
        deepest = max(deepest, nesting)
    if deepest > MAX_GRAMMAR_NESTING:
        return (f"its grammar nests {deepest:,} groups deep (a pattern's repetitions nest); "
                f"at most {MAX_GRAMMAR_NESTING:,} are allowed")
    if not _llama_parses(grammar):
        return "llama.cpp cannot parse its grammar (a pattern's repetitions, or a $ref to itself)"
    return None


def _llama_parses(grammar: str) -> bool:
    """Whether llama.cpp's grammar parser takes the grammar (no vocabulary is
    needed to parse it)."""
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(None, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


# -- the answer ----------------------------------------------------------------------


def json_violation(fmt: ResponseFormat, text: str) -> str | None:
    """What is wrong with an answer given in a JSON format, or None when it is right."""
    try:
        value = json.loads(text)
    except RecursionError:
        return "the answer is nested too deeply to read"
    except ValueError as exc:
        return f"the answer is not JSON: {exc}"
    if fmt["type"] == "json_object":
        return None if isinstance(value, dict) else "the answer is not a JSON object"
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(json.loads(fmt["schema"]))
    try:
        error = next(iter(validator.iter_errors(value)), None)
    except RecursionError:
        return "the answer is nested too deeply to check against the schema"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(the root)"
    return f"the answer does not match the schema at {where}: {error.message}"


def wire_format(fmt: ResponseFormat) -> dict[str, Any]:
    """The format in OpenAI's ``response_format`` shape (for an upstream engine)."""
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {
        "name": fmt["name"], "schema": json.loads(fmt["schema"]), "strict": fmt["strict"]}}

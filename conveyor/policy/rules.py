"""Content policies: what they say, how scopes combine, and the book of them a
process serves by. A policy is a TOML document set for everyone
(``default``), a tenant (``tenant:<name>``) or a key (``key:<id>``), followed
on ``conveyor.policies`` (topics/policies.py). Scopes add up for safety and
override field by field for ``[pii]`` and ``[cache]``; a bad document is
refused whole when set (ConveyorError naming section and field), and one that
reaches a process anyway is logged and passed over. For operators:
docs/operating/policies.md. A document::

    [safety]                      # level 1: keyword and pattern lists
    blocked = { violence = ["how to make a bomb"] }   # input and output
    input = { custom = ["project nightingale"] }      # input only
    output = { custom = ["internal use only"] }       # answers only
    patterns = { secrets = ['\\bsk-[a-z0-9]{20,}\\b'] }  # regexes, both ways
    classifier = 0.9              # level 2: block input the classifier scores >= 0.9

    [pii]                         # personal data replaced before the log sees it
    redact = ["email", "phone", "card", "iban", "ip"]   # [] redacts nothing
    restore = true                # the originals put back into the answer
    region = "US"                 # phone numbers without a country code

    [cache]                       # the exact prompt cache
    enabled = true
    ttl_s = 600
    semantic = true               # and the semantic one (workers/route/semantic_cache.py):
    similarity = 0.95             # a paraphrase at least this similar is answered from it
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ConveyorError
from conveyor.policy.recognisers import ENTITIES
from conveyor.policy.safety import TermList

__all__ = ["DEFAULT_SCOPE", "Policy", "PolicyBook", "PolicyDoc", "key_scope", "parse_policy",
           "tenant_scope"]

DEFAULT_SCOPE = "default"
_MAX_CACHE_TTL_S = 7 * 86_400
_SECTIONS = {"safety": {"blocked", "input", "output", "patterns", "classifier"},
             "pii": {"redact", "restore", "region"},
             "cache": {"enabled", "ttl_s", "semantic", "similarity"}}

Lists = dict[str, tuple[str, ...]]  # category -> terms (or patterns)


def tenant_scope(tenant: str) -> str:
    return f"tenant:{tenant}"


def key_scope(key_id: str) -> str:
    return f"key:{key_id}"


@dataclass(frozen=True)
class PolicyDoc:
    """One scope's document, parsed: what it sets, and None for what it leaves."""

    blocked: Lists = field(default_factory=dict)
    input: Lists = field(default_factory=dict)
    output: Lists = field(default_factory=dict)
    patterns: Lists = field(default_factory=dict)
    classifier: float | None = None  # level 2's threshold (conveyor/policy/classifier.py)
    redact: tuple[str, ...] | None = None
    restore: bool | None = None
    region: str | None = None
    cache: bool | None = None
    cache_ttl_s: int | None = None
    semantic_cache: bool | None = None
    semantic_similarity: float | None = None


@dataclass(frozen=True)
class Policy:
    """What applies to one request: every scope of it combined."""

    input_terms: TermList
    output_terms: TermList
    classifier: float | None = None  # the strictest threshold of the scopes
    redact: tuple[str, ...] = ()
    restore: bool = True
    region: str = "US"
    cache: bool = False
    cache_ttl_s: int = 600
    semantic_cache: bool = False
    semantic_similarity: float = 0.95
    scopes: tuple[str, ...] = ()  # the scopes that had a say, broadest first

    def described(self) -> dict[str, Any]:
        """What it does, as ``conveyor policies show --tenant`` and the console show it."""
        return {"scopes": list(self.scopes),
                "input_categories": list(self.input_terms.categories),
                "output_categories": list(self.output_terms.categories),
                "classifier": self.classifier,
                "pii": {"redact": list(self.redact), "restore": self.restore,
                        "region": self.region},
                "cache": {"enabled": self.cache, "ttl_s": self.cache_ttl_s,
                          "semantic": self.semantic_cache,
                          "similarity": self.semantic_similarity}}


def parse_policy(text: str, source: str = "the policy") -> PolicyDoc:
    """A document, checked whole: ConveyorError naming what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConveyorError(f"{source} is not TOML: {exc}") from exc
    for section, value in data.items():
        if section not in _SECTIONS:
            raise ConveyorError(f"{source}: unknown section [{section}] "
                                f"(known: {', '.join(sorted(_SECTIONS))})")
        if not isinstance(value, dict):
            raise ConveyorError(f"{source}: [{section}] must be a table")
        unknown = set(value) - _SECTIONS[section]
        if unknown:
            raise ConveyorError(f"{source}: unknown field {section}.{sorted(unknown)[0]} "
                                f"(known: {', '.join(sorted(_SECTIONS[section]))})")
    safety = data.get("safety", {})
    lists = {name: _lists(safety.get(name, {}), f"{source}: safety.{name}")
             for name in ("blocked", "input", "output", "patterns")}
    threshold = safety.get("classifier")
    if threshold is not None and not (isinstance(threshold, int | float)
                                      and not isinstance(threshold, bool)
                                      and 0 < threshold <= 1):
        raise ConveyorError(f"{source}: safety.classifier must be a threshold above 0, "
                            "at most 1")
    doc = PolicyDoc(blocked=lists["blocked"], input=lists["input"], output=lists["output"],
                    patterns=lists["patterns"],
                    classifier=None if threshold is None else float(threshold),
                    **_pii(data.get("pii", {}), source),
                    **_cache(data.get("cache", {}), source))
    for name, lists_ in lists.items():  # every list builds (a bad regex, an empty term)
        try:
            TermList(patterns=lists_) if name == "patterns" else TermList(lists_)
        except ValueError as exc:
            raise ConveyorError(f"{source}: safety.{name}: {exc}") from exc
    return doc


def _lists(value: Any, where: str) -> Lists:
    if not isinstance(value, dict):
        raise ConveyorError(f"{where} must be a table of category = [terms]")
    out: Lists = {}
    for category, terms in value.items():
        if not isinstance(terms, list) or not all(isinstance(t, str) for t in terms):
            raise ConveyorError(f"{where}.{category} must be a list of strings")
        out[str(category)] = tuple(terms)
    return out


def _pii(section: dict[str, Any], source: str) -> dict[str, Any]:
    redact = section.get("redact")
    if redact is not None:
        if not isinstance(redact, list) or not all(isinstance(e, str) for e in redact):
            raise ConveyorError(f"{source}: pii.redact must be a list of entity names")
        unknown = [e for e in redact if e not in ENTITIES]
        if unknown:
            raise ConveyorError(f"{source}: pii.redact names {unknown[0]!r}, which is not "
                                f"one of {', '.join(ENTITIES)}")
        redact = tuple(dict.fromkeys(redact))
    restore = section.get("restore")
    if restore is not None and not isinstance(restore, bool):
        raise ConveyorError(f"{source}: pii.restore must be true or false")
    region = section.get("region")
    if region is not None and not (isinstance(region, str) and len(region) == 2
                                   and region.isalpha()):
        raise ConveyorError(f"{source}: pii.region must be a two-letter country code")
    return {"redact": redact, "restore": restore,
            "region": region.upper() if isinstance(region, str) else None}


def _cache(section: dict[str, Any], source: str) -> dict[str, Any]:
    enabled = section.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise ConveyorError(f"{source}: cache.enabled must be true or false")
    ttl = section.get("ttl_s")
    if ttl is not None and not (isinstance(ttl, int) and not isinstance(ttl, bool)
                                and 1 <= ttl <= _MAX_CACHE_TTL_S):
        raise ConveyorError(f"{source}: cache.ttl_s must be a whole number of seconds "
                            f"from 1 to {_MAX_CACHE_TTL_S}")
    semantic = section.get("semantic")
    if semantic is not None and not isinstance(semantic, bool):
        raise ConveyorError(f"{source}: cache.semantic must be true or false")
    similarity = section.get("similarity")
    if similarity is not None and not (isinstance(similarity, int | float)
                                       and not isinstance(similarity, bool)
                                       and 0 < similarity <= 1):
        raise ConveyorError(f"{source}: cache.similarity must be a cosine similarity above 0, "
                            "at most 1")
    return {"cache": enabled, "cache_ttl_s": ttl, "semantic_cache": semantic,
            "semantic_similarity": None if similarity is None else float(similarity)}


def _union(*lists: Mapping[str, tuple[str, ...]]) -> Lists:
    out: dict[str, dict[str, None]] = {}
    for one in lists:
        for category, terms in one.items():
            out.setdefault(category, {}).update(dict.fromkeys(terms))
    return {category: tuple(terms) for category, terms in out.items()}


class PolicyBook:
    """Every scope's document a process knows, and the effective policy of a
    request from them (cached until a document changes)."""

    def __init__(self) -> None:
        self._docs: dict[str, tuple[str, PolicyDoc]] = {}  # scope -> (digest, doc)
        self._effective: dict[tuple[str, str], Policy] = {}
        self.version = 0

    def set(self, scope: str, text: str, source: str = "the policy") -> bool:
        """Serve ``scope`` by ``text`` ("" clears it); whether anything changed.
        ConveyorError for a document that does not parse (the scope keeps its own)."""
        digest = hashlib.sha256(text.encode()).hexdigest()
        held = self._docs.get(scope)
        if held is not None and held[0] == digest or held is None and not text.strip():
            return False
        if text.strip():
            self._docs[scope] = (digest, parse_policy(text, source))
        else:
            del self._docs[scope]
        self._effective.clear()
        self.version += 1
        return True

    def scopes(self) -> list[str]:
        return sorted(self._docs)

    def effective(self, tenant: str, key_id: str = "") -> Policy:
        cached = self._effective.get((tenant, key_id))
        if cached is not None:
            return cached
        names = [DEFAULT_SCOPE, tenant_scope(tenant)] + ([key_scope(key_id)] if key_id else [])
        docs = [(name, self._docs[name][1]) for name in names if name in self._docs]
        policy = _combine(docs)
        if len(self._effective) > 10_000:
            self._effective.clear()
        self._effective[(tenant, key_id)] = policy
        return policy


def _combine(docs: list[tuple[str, PolicyDoc]]) -> Policy:
    chosen: dict[str, Any] = {}
    for _, doc in docs:  # broadest first: the later scope wins field by field
        for name in ("redact", "restore", "region", "cache", "cache_ttl_s", "semantic_cache",
                     "semantic_similarity"):
            value = getattr(doc, name)
            if value is not None:
                chosen[name] = value
    every = [doc for _, doc in docs]
    thresholds = [d.classifier for d in every if d.classifier is not None]
    if thresholds:
        chosen["classifier"] = min(thresholds)
    blocked = _union(*(d.blocked for d in every))
    patterns = _union(*(d.patterns for d in every))
    return Policy(
        input_terms=TermList(_union(blocked, *(d.input for d in every)), patterns),
        output_terms=TermList(_union(blocked, *(d.output for d in every)), patterns),
        scopes=tuple(name for name, _ in docs), **chosen)

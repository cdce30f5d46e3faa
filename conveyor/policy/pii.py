"""Personal data in a request: found (recognisers.py), replaced with
placeholders ``<ENTITY_n>`` by a :class:`Redactor`, and put back by a
:class:`~conveyor.policy.restore.Restorer` built from its mapping. Values are
compared as written, so a restore puts back exactly the user's text; a
restore never puts a value where the user had none (placeholder-shaped text is
skipped or replaced itself). :class:`FindMemo` keeps recent findings by a
digest of the text, never the text. Why and what it costs:
docs/decisions/0016-personal-data-redacted-at-the-edge.md.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Collection

from conveyor.policy.recognisers import ENTITIES, Found, checked_entities, find_checked

__all__ = ["FindMemo", "Redactor"]

_TAGS: dict[str, str] = {entity: entity.upper() for entity in ENTITIES}
_LITERAL = ""  # the entity of a typed placeholder that is replaced like a value

_PLACEHOLDER_SHAPE = re.compile(
    r"<(" + "|".join(_TAGS.values()) + r")_([1-9][0-9]*)>"
)


# --- what was found in texts seen lately ---------------------------------------------------


class FindMemo:
    """The recognisers' findings (entity and span) for the last ``size`` distinct texts
    of at least ``min_chars`` characters; shorter texts are searched every time (the
    cheap checks skip most recognisers on them). Safe to share between threads."""

    def __init__(self, size: int = 8192, min_chars: int = 24) -> None:
        if size < 0:
            raise ValueError("size must be >= 0")
        self._size = size
        self._min_chars = min_chars
        self._spans: OrderedDict[tuple[bytes, tuple[str, ...], str],
                                 tuple[tuple[str, int, int], ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._spans)

    def find(self, text: str, entities: tuple[str, ...], region: str) -> list[Found]:
        """``find_checked(text, entities, region)``, from the memo when ``text`` was seen."""
        if self._size == 0 or len(text) < self._min_chars:
            return find_checked(text, entities, region)
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        key = (digest, entities, region)
        with self._lock:
            spans = self._spans.get(key)
            if spans is not None:
                self._spans.move_to_end(key)
                self.hits += 1
        if spans is not None:
            return [Found(entity, start, end, text[start:end]) for entity, start, end in spans]
        found = find_checked(text, entities, region)
        with self._lock:
            self.misses += 1
            self._spans[key] = tuple((f.entity, f.start, f.end) for f in found)
            while len(self._spans) > self._size:
                self._spans.popitem(last=False)
        return found


# --- redaction ---------------------------------------------------------------------------


class Redactor:
    """One request's redaction: the same value gets the same placeholder in every
    message, numbered per entity in order of first appearance (<EMAIL_1>,
    <PHONE_1>, <EMAIL_2> ...). ``memo`` holds what was found in texts searched
    before (kept by whoever redacts many requests); without one every text is searched.
    """

    def __init__(self, entities: Collection[str] = ENTITIES, *, region: str = "US",
                 memo: FindMemo | None = None) -> None:
        self._memo = memo
        self._entities = checked_entities(entities)
        self._region = region.upper()
        self._mapping: dict[str, str] = {}
        self._placeholder_of: dict[tuple[str, str], str] = {}
        self._last: dict[str, int] = dict.fromkeys(_TAGS.values(), 0)
        self._reserved: dict[str, set[int]] = {tag: set() for tag in _TAGS.values()}
        self._counts: dict[str, int] = dict.fromkeys(self._entities, 0)

    @property
    def mapping(self) -> dict[str, str]:
        """Placeholder -> original text (a copy): what a :class:`Restorer` (restore.py) needs."""
        return dict(self._mapping)

    @property
    def counts(self) -> dict[str, int]:
        """Entity -> how many distinct values were replaced (every redacted entity listed)."""
        return dict(self._counts)

    def redact(self, text: str) -> str:
        """``text`` with every value of the redacted entities replaced by its placeholder."""
        literals = list(_PLACEHOLDER_SHAPE.finditer(text))
        for m in literals:
            if m.group() not in self._mapping:
                self._reserved[m.group(1)].add(int(m.group(2)))
        searched = find_checked(text, self._entities, self._region) if self._memo is None \
            else self._memo.find(text, self._entities, self._region)
        found = [f for f in searched
                 if not any(f.start < m.end() and m.start() < f.end for m in literals)]
        # A typed placeholder that is already minted is replaced like a value.
        found += [Found(_LITERAL, m.start(), m.end(), m.group())
                  for m in literals if m.group() in self._mapping]
        found.sort(key=lambda f: f.start)
        return self._replace(text, found)

    def _replace(self, text: str, found: list[Found]) -> str:
        parts: list[str] = []
        pos = 0
        for f in found:
            parts += (text[pos:f.start], self._placeholder(f))
            pos = f.end
        parts.append(text[pos:])
        return "".join(parts)

    def _placeholder(self, f: Found) -> str:
        key = (f.entity, f.text)
        placeholder = self._placeholder_of.get(key)
        if placeholder is None:
            tag = f.text[1:f.text.rindex("_")] if f.entity == _LITERAL else _TAGS[f.entity]
            placeholder = self._mint(tag)
            self._placeholder_of[key] = placeholder
            self._mapping[placeholder] = f.text
            if f.entity != _LITERAL:
                self._counts[f.entity] += 1
        return placeholder

    def _mint(self, tag: str) -> str:
        n = self._last[tag] + 1
        while n in self._reserved[tag]:
            n += 1
        self._last[tag] = n
        return f"<{tag}_{n}>"

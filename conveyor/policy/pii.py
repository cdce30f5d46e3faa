"""Personal data in a request: found, replaced with placeholders, and put back into the answer.

A tenant's ``[pii]`` policy names the entities to redact. Before a request reaches the model
(and the logs), a :class:`Redactor` replaces each value the recognisers find (recognisers.py
says what each catches and misses) with a placeholder such as ``<EMAIL_1>``; a
:class:`Restorer` (restore.py) built from the redactor's mapping puts the originals back
into the answer, whole or as it streams.

Placeholders are ``<ENTITY_n>`` with the entity in capitals and ``n`` counted per entity
from 1 in order of first appearance in one request (one :class:`Redactor`). The same text
gets the same placeholder in every message of the request, so the model can still tell
that two mentions are one person. Values are compared as written: ``+1 202 555 0143`` and
``(202) 555-0143`` get two placeholders, so a restore always puts back exactly the text the
user wrote at that place.

A user may type something that looks like a placeholder (``<EMAIL_1>``). A restore must
never put a value where the user did not have one, so the redactor guarantees that every
placeholder of its mapping stands, in everything it has returned, only where it replaced
that value:

* numbering skips every placeholder-shaped text (``<EMAIL_7>``) seen in the texts redacted
  so far, this one included, so a minted placeholder never equals something a user typed
  before it was minted; such texts are left as they are and the restorer leaves them alone,
  since it only restores placeholders of its mapping;
* a text that types a placeholder already minted (``<EMAIL_1>`` after an address got it) has
  that text replaced like a value, with a fresh placeholder (``<EMAIL_2>``) whose original
  is the literal ``<EMAIL_1>``: the restore puts back what the user typed. Such literals
  are not counted in :attr:`Redactor.counts`.

A placeholder cannot arise across the edge of a replacement either: ``<`` and ``>`` appear
in a placeholder only at its ends. Values are never looked for inside a placeholder-shaped
text. What is left is the model inventing a placeholder it never saw, which no redactor
can tell from a real one.

Restoring replaces only exact placeholders of the mapping, in one pass (a restored value
that looks like a placeholder is not restored again). Models sometimes alter placeholders
(``<Email_1>``, ``<EMAIL 1>``, ``EMAIL_1``); those are left as they are: the user then sees a
placeholder, never a value guessed into the wrong place.

Streaming: an answer arrives in chunks and a placeholder may be split across two of them
(``"<EMA"`` + ``"IL_1>"``). ``Restorer.feed`` sends at once everything that can no longer
become part of a placeholder, and holds back only a tail that is the start of one of the
mapping's placeholders: at most the longest placeholder's length minus one characters, so
the client waits for a few characters, never for the whole answer, and memory stays
bounded. Streamed output equals ``Restorer.restore`` of the whole answer, however it is
chunked.

Repeated texts: a conversation sends every earlier turn again with each new one, and an
application sends the same system prompt with every request, so most of what a gateway
redacts it has redacted before. What the recognisers found in a text is a function of the
text, the entities and the region alone, so :class:`FindMemo` keeps it for the texts seen
lately, keyed by a 128-bit BLAKE2b digest of the text (never the text: the memo holds
spans and entity names, no personal data), bounded in entries; the placeholders are still
minted per request. What redaction, restoration and the memo cost:
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
    """One request's redaction: the same value gets the same placeholder in every message
    of the request; placeholders are numbered per entity in order of first appearance:
    <EMAIL_1>, <PHONE_1>, <CARD_1>, <IBAN_1>, <IP_1>, <EMAIL_2> ... ``memo`` holds what
    the recognisers found in texts searched before, kept by whoever redacts many
    requests (the gateway, the jobs layer); without one every text is searched.

    Placeholder-shaped texts typed by the user are never confused with real placeholders:
    numbering skips those seen so far, and one typed after its number was minted is itself
    replaced with a fresh placeholder whose original is that literal text (module docstring).
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

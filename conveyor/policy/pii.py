"""Personal data in a request: found, replaced with placeholders, and put back into the answer.

A tenant's ``[pii]`` policy names the entities to redact. Before a request reaches the model
(and the logs), a :class:`Redactor` replaces each value with a placeholder such as
``<EMAIL_1>``; a :class:`Restorer` (restore.py) built from the redactor's mapping puts
the originals back into the answer, whole or as it streams. Pure Python: the standard
library and ``phonenumbers``.

What each recogniser catches, and what it misses on purpose:

* ``email``: a pragmatic RFC 5322 subset, ``local@domain.tld``: a dot-atom local part
  (letters, digits and ``!#$%&'*+/=?^_`{|}~-``, single dots between), dot-separated domain
  labels and an alphabetic top-level domain of 2-63 letters, not inside a longer word.
  Missed: quoted local parts (``"john doe"@x.com``), IP-literal domains (``a@[10.0.0.1]``),
  non-ASCII addresses, local parts over RFC 5321's 64 characters, and names without a TLD
  (``root@localhost``).
* ``phone``: ``phonenumbers.PhoneNumberMatcher`` with leniency ``VALID``: international
  numbers (``+44 20 7946 0958``) of any country, and national numbers of the default
  ``region`` (``"US"`` unless the policy says otherwise). Only numbers the library's metadata
  says are valid, so ``(123) 456-7890`` is not one. An unknown region finds only
  international numbers. The matcher is the slow part (see Speed), so a text with fewer
  digits than the shortest valid number (6 internationally, e.g. ``+98 9601``, fewer if the
  region has shorter national numbers) skips it.
* ``card``: 13-19 digits, written as one run or in groups of 3-8 digits separated by one
  space or one dash (the same separator throughout), that pass the Luhn checksum. A run
  of groups that is too long (a card number followed by its CVV) is searched for the
  longest valid run of consecutive groups. Missed: cards written with dots or odd spacing,
  and any number that fails Luhn (a typo, or a test number such as ...1112).
* ``iban``: two capital letters, two check digits and 11-30 capitals or digits, written
  compact or in groups of four separated by one space. Kept only when the country is in
  :data:`IBAN_LENGTHS` (the SEPA countries and some others; an unknown country is rejected),
  the length is that country's, the check digits are 02-98 and the ISO 13616 mod-97 check
  gives 1. Missed: lower-case IBANs and IBANs of countries not in the table.
* ``ip``: IPv4 dotted quads (each part 0-255, no leading zeros) and IPv6 addresses
  (with ``::`` and an embedded IPv4 tail), each checked with :mod:`ipaddress`, and not part
  of a longer token: the ``1.2.3.4`` of a version string ``1.2.3.4.5`` or ``v1.2.3.4`` is not
  an address. ``::`` alone and zone indexes (``fe80::1%eth0``: the address is found, the
  zone left) are not addresses; MAC addresses and clock times do not parse as IPv6.

When two recognisers claim overlapping spans, the span that starts first wins, then the
longer one, then the entity listed first in :data:`ENTITIES`: a card number is not also a
phone number, and the digits of an IBAN are not a card.

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

Speed (``timeit``, CPython 3.11, one core of the development machine, 2,000-character
texts): with an email and a US phone number, redacting with all five recognisers takes
about 0.14 ms, 0.10 ms of it ``phonenumbers``' matcher; with an email, a phone number, a card,
an IBAN and an IPv4 address, about 0.64 ms, 0.53 ms of it the matcher, which parses every
run of digits as a candidate number (about 30 microseconds each, the card's, IBAN's and
address's digits included), against 0.07 ms for the other four together. Prose with fewer
than 6 digits skips the matcher: about 0.013 ms with all five. The regexes start with a
character class or are anchored on ``@`` and cheap checks (enough digits, a dot, ``::``)
skip a recogniser that cannot match. Restoring a 2,000-character answer with five
placeholders takes about 2 microseconds whole and 0.12 ms fed in 20-character chunks
(about 1 microsecond a chunk).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import lru_cache

import phonenumbers

__all__ = [
    "ENTITIES",
    "IBAN_LENGTHS",
    "Found",
    "Redactor",
    "find_pii",
]

ENTITIES: tuple[str, ...] = ("email", "phone", "card", "iban", "ip")

# IBAN length per country (ISO 13616 registry): all SEPA countries and some others.
IBAN_LENGTHS: dict[str, int] = {
    # SEPA
    "AD": 24, "AL": 28, "AT": 20, "BE": 16, "BG": 22, "CH": 21, "CY": 28, "CZ": 24,
    "DE": 22, "DK": 18, "EE": 20, "ES": 24, "FI": 18, "FR": 27, "GB": 22, "GI": 23,
    "GR": 27, "HR": 21, "HU": 28, "IE": 22, "IS": 26, "IT": 27, "LI": 21, "LT": 20,
    "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MT": 31, "NL": 18,
    "NO": 15, "PL": 28, "PT": 25, "RO": 24, "SE": 24, "SI": 19, "SK": 24, "SM": 27,
    "VA": 22,
    # others
    "AE": 23, "AZ": 28, "BA": 20, "BH": 22, "BR": 29, "BY": 28, "CR": 22, "DO": 28,
    "EG": 29, "FO": 18, "GE": 22, "GL": 18, "GT": 28, "IL": 23, "IQ": 23, "JO": 30,
    "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "MR": 27, "MU": 30, "PK": 24, "PS": 29,
    "QA": 29, "RS": 22, "SA": 24, "SC": 31, "ST": 25, "SV": 28, "TL": 23, "TN": 24,
    "TR": 26, "UA": 29, "VG": 24, "XK": 20,
}

# The fewest digits of any valid international number (country code + shortest national
# number over all regions of phonenumbers' metadata, e.g. +98 9601); a test checks it.
_PHONE_MIN_INTERNATIONAL_DIGITS = 6

_TAGS: dict[str, str] = {entity: entity.upper() for entity in ENTITIES}
_LITERAL = ""  # the entity of a typed placeholder that is replaced like a value

_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
# The card, IBAN and IPv4 regexes start with a single character class and look behind only
# after it: a pattern that starts with a look-behind or a repeat is tried at every position,
# twice as slow. (The IPv6 one runs only on texts with "::" or six colons.)
# An email is looked for around each "@": the local part ending there (at most 64 characters,
# RFC 5321), then the domain starting after it.
_EMAIL_LOCAL = re.compile(rf"(?<![\w.!#$%&'*+/=?^`{{|}}~@-]){_ATOM}(?:\.{_ATOM})*\Z")
_EMAIL_DOMAIN = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}"
    r"(?![\w@-]|\.[A-Za-z0-9])"
)
_CARD = re.compile(
    r"[0-9](?<![\w.,][0-9])"
    r"(?:[0-9]{12,18}|[0-9]{2,7}(?P<sep>[ -])[0-9]{3,8}(?:(?P=sep)[0-9]{3,8})*)"
    r"(?![\w]|[.,][0-9])"
)
_IBAN = re.compile(
    r"[A-Z][A-Z][0-9]{2}(?<![A-Za-z0-9][A-Z]{2}[0-9]{2})"
    r"(?:[A-Z0-9]{11,30}|(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?)"
    r"(?![A-Za-z0-9])"
)
# Not preceded by a word character or a dot: checked on the match (the same, as every
# position inside a quad follows a digit or a dot).
_IPV4 = re.compile(r"[0-9][0-9]{0,2}(?:\.[0-9]{1,3}){3}(?![\w]|\.[0-9])")
_WORD_OR_DOT = re.compile(r"[\w.]")
_IPV6 = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}"
    r"(?:[0-9]{1,3}(?:\.[0-9]{1,3}){3}|[0-9A-Fa-f]{0,4})(?![\w:]|\.[0-9])"
)
_HEX_DIGIT = re.compile(r"[0-9A-Fa-f]")
_DIGIT = re.compile(r"\d")
_PLACEHOLDER_SHAPE = re.compile(
    r"<(" + "|".join(_TAGS.values()) + r")_([1-9][0-9]*)>"
)


@dataclass(frozen=True)
class Found:
    """One value found: its entity, its span in the text, and the text of the span."""

    entity: str
    start: int
    end: int
    text: str


# --- recognisers -------------------------------------------------------------------------


def _ascii_digits(text: str) -> int:
    """How many of 0-9 ``text`` holds (ten C-speed scans: cheaper than a regex)."""
    return sum(map(text.count, "0123456789"))


def _find_emails(text: str, region: str, digits: int) -> Iterator[Found]:
    at = text.find("@")
    while at >= 0:
        local = _EMAIL_LOCAL.search(text, max(0, at - 64), at)
        domain = _EMAIL_DOMAIN.match(text, at + 1) if local else None
        if local and domain:
            yield Found("email", local.start(), domain.end(), text[local.start():domain.end()])
        at = text.find("@", at + 1)


@lru_cache(maxsize=64)
def _phone_min_digits(region: str) -> int:
    """Fewer digits than this in a text and the phone matcher cannot find anything."""
    metadata = phonenumbers.PhoneMetadata.metadata_for_region(region)
    desc = metadata.general_desc if metadata is not None else None
    lengths = desc.possible_length if desc is not None else ()
    return min((_PHONE_MIN_INTERNATIONAL_DIGITS, *lengths))


def _find_phones(text: str, region: str, digits: int) -> Iterator[Found]:
    needed = _phone_min_digits(region)
    if digits < needed and not text.isascii():
        digits = len(_DIGIT.findall(text))  # phonenumbers also reads other scripts' digits
    if digits < needed:
        return
    matcher = phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID)
    for m in matcher:
        yield Found("phone", m.start, m.end, m.raw_string)


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_ok(candidate: str) -> bool:
    digits = candidate.replace(" ", "").replace("-", "")
    return 13 <= len(digits) <= 19 and digits.isascii() and _luhn_ok(digits)


def _group_spans(text: str, start: int, end: int, sep: str | None) -> list[tuple[int, int]]:
    """The spans of the digit groups of ``text[start:end]``, split at ``sep``."""
    if sep is None:
        return [(start, end)]
    spans: list[tuple[int, int]] = []
    pos = start
    for group in text[start:end].split(sep):
        spans.append((pos, pos + len(group)))
        pos += len(group) + 1
    return spans


def _best_group_run(text: str, groups: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The leftmost, then longest, run of consecutive groups that is a valid card number."""
    for first in range(len(groups)):
        for last in range(len(groups) - 1, first - 1, -1):
            start, end = groups[first][0], groups[last][1]
            if _card_ok(text[start:end]):
                return start, end
    return None


def _find_cards(text: str, region: str, digits: int) -> Iterator[Found]:
    if digits < 13:
        return
    for m in _CARD.finditer(text):
        groups = _group_spans(text, m.start(), m.end(), m.group("sep"))
        best = _best_group_run(text, groups)
        if best is not None:
            yield Found("card", best[0], best[1], text[best[0]:best[1]])


def _iban_ok(candidate: str) -> bool:
    compact = candidate.replace(" ", "")
    if IBAN_LENGTHS.get(compact[:2]) != len(compact) or not 2 <= int(compact[2:4]) <= 98:
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def _find_ibans(text: str, region: str, digits: int) -> Iterator[Found]:
    if digits < 2:
        return
    for m in _IBAN.finditer(text):
        end = m.end()
        # A spaced IBAN followed by a group-like token (``... 7034 2024``) is tried shorter.
        while end - m.start() >= 15:
            if _iban_ok(text[m.start():end]):
                yield Found("iban", m.start(), end, text[m.start():end])
                break
            cut = text.rfind(" ", m.start(), end)
            if cut < 0:
                break
            end = cut


def _find_ips(text: str, region: str, digits: int) -> Iterator[Found]:
    if digits >= 4 and "." in text:
        for m in _IPV4.finditer(text):
            glued = m.start() > 0 and _WORD_OR_DOT.match(text, m.start() - 1) is not None
            if not glued and _parses(ipaddress.IPv4Address, m.group()):
                yield Found("ip", m.start(), m.end(), m.group())
    # An IPv6 address has "::" or at least six colons (seven, or six before an IPv4 tail).
    if "::" in text or text.count(":") >= 6:
        for m in _IPV6.finditer(text):
            if _HEX_DIGIT.search(m.group()) and _parses(ipaddress.IPv6Address, m.group()):
                yield Found("ip", m.start(), m.end(), m.group())


def _parses(kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address], s: str) -> bool:
    try:
        kind(s)
    except ValueError:
        return False
    return True


_RECOGNISERS: dict[str, Callable[[str, str, int], Iterator[Found]]] = {
    "email": _find_emails,
    "phone": _find_phones,
    "card": _find_cards,
    "iban": _find_ibans,
    "ip": _find_ips,
}


def _checked_entities(entities: Collection[str]) -> tuple[str, ...]:
    """The entities in :data:`ENTITIES` order; ValueError naming an unknown one."""
    if isinstance(entities, str):
        raise TypeError("entities must be a collection of entity names, not one string")
    for entity in entities:
        if entity not in _RECOGNISERS:
            raise ValueError(f"unknown PII entity {entity!r}; known: {', '.join(ENTITIES)}")
    return tuple(e for e in ENTITIES if e in entities)


def _resolve_overlaps(found: list[Found]) -> list[Found]:
    """Earlier start first, then the longer span, then the entity listed first."""
    found.sort(key=lambda f: (f.start, f.start - f.end, ENTITIES.index(f.entity)))
    kept: list[Found] = []
    for f in found:
        if not kept or f.start >= kept[-1].end:
            kept.append(f)
    return kept


def _find(text: str, entities: tuple[str, ...], region: str) -> list[Found]:
    digits = _ascii_digits(text)
    found = [f for entity in entities for f in _RECOGNISERS[entity](text, region, digits)]
    return _resolve_overlaps(found)


def find_pii(text: str, entities: Collection[str] = ENTITIES, *, region: str = "US") -> list[Found]:
    """The values of ``entities`` in ``text``, ordered by start and not overlapping.

    ``region`` is the country of phone numbers written without a country code (any case).
    Raises ValueError naming an unknown entity, TypeError for one string instead of a
    collection of names (``"email"`` would otherwise read as five one-letter names).
    """
    return _find(text, _checked_entities(entities), region.upper())


# --- redaction ---------------------------------------------------------------------------


class Redactor:
    """One request's redaction: the same value gets the same placeholder in every message
    of the request; placeholders are numbered per entity in order of first appearance:
    <EMAIL_1>, <PHONE_1>, <CARD_1>, <IBAN_1>, <IP_1>, <EMAIL_2> ...

    Placeholder-shaped texts typed by the user are never confused with real placeholders:
    numbering skips those seen so far, and one typed after its number was minted is itself
    replaced with a fresh placeholder whose original is that literal text (module docstring).
    """

    def __init__(self, entities: Collection[str] = ENTITIES, *, region: str = "US") -> None:
        self._entities = _checked_entities(entities)
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
        found = [f for f in _find(text, self._entities, self._region)
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

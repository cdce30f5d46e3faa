"""Personal data in a text: the recognisers behind redaction (pii.py): email,
phone, card, iban and ip, pure Python (the standard library and
``phonenumbers``). Of overlapping spans the one that starts first wins, then
the longer, then the entity listed first in :data:`ENTITIES`. What each
catches and misses on purpose: docs/operating/policies.md#what-each-recogniser-finds.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import lru_cache

import phonenumbers

__all__ = ["ENTITIES", "IBAN_LENGTHS", "Found", "checked_entities", "find_checked"]

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


def checked_entities(entities: Collection[str]) -> tuple[str, ...]:
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


def find_checked(text: str, entities: tuple[str, ...], region: str) -> list[Found]:
    """The values of ``entities`` (:func:`checked_entities`) in ``text``, ordered
    by start and not overlapping; ``region`` (upper case) is the country of phone
    numbers written without a country code."""
    digits = _ascii_digits(text)
    found = [f for entity in entities for f in _RECOGNISERS[entity](text, region, digits)]
    return _resolve_overlaps(found)


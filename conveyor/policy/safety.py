"""Level 1 of the content policy: keyword and pattern lists, on a text or on a stream.

A :class:`TermList` holds a policy's literal terms and regex patterns by
category; :meth:`TermList.first` and :meth:`TermList.all` check a whole text,
a :class:`StreamScanner` an answer as it streams, holding back only what a
match could still include. Terms match whole words, case-insensitively, on
folded text (:func:`fold`: lower case and compatibility forms one character for
one, whitespace runs as one space, offsets traced back); patterns are
``re.IGNORECASE`` regexes on the original. The rules in full, and what is not caught:
docs/decisions/0017-safety-in-levels.md#level-1s-rules-in-detail.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import ahocorasick
import regex as regex_module

__all__ = ["PATTERN_SPAN", "Folded", "Match", "StreamScanner", "TermList", "fold"]

PATTERN_SPAN = 256

_PROBES = ("", "a", "0", " ", "\n", "-", "aB 0_c.-\n")


# -- folding: text and terms compared one character for one ---------------------------

_SPACES = re.compile(r"\s(?:\s+|(?<=[^ ]))")
_FINAL_SIGMA, _SIGMA = "ς", "σ"
_DOTTED_I = "\u0130"
_TABLE_SIZE = 65_536


@dataclass(frozen=True)
class Folded:
    """A text folded for terms, and the way back to the original's offsets."""

    text: str
    marks: tuple[int, ...] = (0,)
    origins: tuple[int, ...] = (0,)

    def origin(self, index: int) -> int:
        """The original's offset of the folded text's ``index``."""
        k = bisect_right(self.marks, index) - 1
        return self.origins[k] + index - self.marks[k]


class _Table(dict[int, str]):
    """``str.translate``'s table of folded characters, filled as they are met."""

    def __missing__(self, code: int) -> str:
        folded = _fold_char(chr(code))
        if len(self) < _TABLE_SIZE:
            self[code] = folded
        return folded


def _fold_char(char: str) -> str:
    compat = unicodedata.normalize("NFKC", char)
    if len(compat) != 1:
        compat = char
    lower = compat.lower()
    folded = lower if len(lower) == 1 else compat
    return _SIGMA if folded == _FINAL_SIGMA else folded


_TABLE = _Table()


def _lower(text: str) -> str:
    """``text`` in lower case and NFKC forms, one character for one."""
    if text.isascii():
        return text.lower()
    if unicodedata.is_normalized("NFKC", text):
        lower = _DOTTED_I.join(part.lower() for part in text.split(_DOTTED_I))
        return lower.replace(_FINAL_SIGMA, _SIGMA)
    return text.translate(_TABLE)


def fold(text: str) -> Folded:
    """``text`` folded, each run of whitespace one space, and the offsets back."""
    lowered = _lower(text)
    if lowered.isprintable() and "  " not in lowered:
        return Folded(lowered)
    pieces: list[str] = []
    marks, origins = [0], [0]
    done = size = 0
    for run in _SPACES.finditer(lowered):
        start, end = run.span()
        pieces += (lowered[done:start], " ")
        size += start - done + 1
        done = end
        if end - start > 1:
            marks.append(size)
            origins.append(end)
    if not pieces:
        return Folded(lowered)
    pieces.append(lowered[done:])
    return Folded("".join(pieces), tuple(marks), tuple(origins))


@dataclass(frozen=True)
class Match:
    """A term or pattern found: as configured, and where (offsets into the text as
    given; in a stream, from the beginning of the stream)."""

    category: str
    term: str
    start: int
    end: int


class _Entry(NamedTuple):
    length: int
    category: str
    term: str


class _Pattern(NamedTuple):
    category: str
    source: str
    regex: re.Pattern[str]
    partial: Any  # the same pattern in the ``regex`` module, which matches partially


_Hit = tuple[int, int, _Entry]


def _matched(folded: Folded, hit: _Hit) -> Match:
    start, end, entry = hit
    return Match(entry.category, entry.term, folded.origin(start), folded.origin(end - 1) + 1)


class TermList:
    """Built once per policy (it is cached by the caller); immutable; thread-safe to read."""

    def __init__(self, terms: Mapping[str, Iterable[str]] | None = None,
                 patterns: Mapping[str, Iterable[str]] | None = None) -> None:
        terms = terms or {}
        patterns = patterns or {}
        self._categories = tuple(sorted({*terms, *patterns}))
        self._automaton, self._longest = _automaton(terms)
        # the first characters of the terms (folded): a tail can begin a term only there
        self._firsts = frozenset(k[0] for k in self._automaton.keys()) \
            if self._automaton is not None else frozenset()
        self._patterns = _compile_all(patterns)
        self._context = PATTERN_SPAN if self._patterns else 1

    @property
    def empty(self) -> bool:
        return self._automaton is None and not self._patterns

    @property
    def window(self) -> int:
        """The most a stream holds back: the longest term, or PATTERN_SPAN with patterns."""
        return max(self._longest, PATTERN_SPAN if self._patterns else 0)

    @property
    def categories(self) -> tuple[str, ...]:
        return self._categories

    def first(self, text: str) -> Match | None:
        """The earliest match in ``text``, or None."""
        found = [self._first_term(text), *(_first(p, text) for p in self._patterns)]
        return min((m for m in found if m is not None), key=_order, default=None)

    def all(self, text: str) -> list[Match]:
        """Every match in ``text``, ordered by start."""
        found: list[Match] = []
        if self._automaton is not None:
            folded = fold(text)
            found.extend(map(partial(_matched, folded), self._hits(folded.text, False, False)))
        for pattern in self._patterns:
            found.extend(_every(pattern, text))
        return sorted(found, key=_order)

    def _first_term(self, text: str) -> Match | None:
        if self._automaton is None:
            return None
        folded = fold(text)
        hit = self._earliest(self._hits(folded.text, False, False))
        return None if hit is None else _matched(folded, hit)

    def _hits(self, norm: str, after_word: bool, open_end: bool) -> Iterator[_Hit]:
        """Whole-word hits in folded text, by end; ``open_end``: none that end it."""
        size = len(norm)
        for last, entry in self._automaton.iter(norm):
            end = last + 1
            start = end - entry.length
            if open_end and end == size:
                continue
            if _clear_before(norm, start, after_word) and (end == size or not _word(norm[end])):
                yield start, end, entry

    def _earliest(self, hits: Iterator[_Hit]) -> _Hit | None:
        best: _Hit | None = None
        for hit in hits:
            if best is not None and hit[1] - self._longest >= best[0]:
                break
            if best is None or hit[:2] < best[:2]:
                best = hit
        return best

    def _open_start(self, norm: str, after_word: bool) -> int:
        """Where the earliest tail of ``norm`` that later text could make a term begins."""
        size = len(norm)
        firsts = self._firsts
        for i in range(max(0, size - self._longest), size):
            if norm[i] in firsts and _clear_before(norm, i, after_word) \
                    and self._automaton.match(norm[i:]):
                return i
        return size

    def _decide(self, before: str, text: str, final: bool) -> tuple[Match | None, int]:
        """For a stream: the first match in ``text`` that later text cannot change, or
        None and where the text that must still be held begins. ``before``: the
        text released just before it; ``final``: nothing follows."""
        found: list[Match | None] = []
        hold = len(text)
        if self._automaton is not None:
            match, hold = self._decide_terms(before, text, final)
            found.append(match)
        for pattern in self._patterns:
            match, start = _decide_pattern(pattern, before, text, final)
            found.append(match)
            hold = min(hold, start)
        match = min((m for m in found if m is not None), key=_order, default=None)
        return match, hold

    def _decide_terms(self, before: str, text: str, final: bool) -> tuple[Match | None, int]:
        after_word = bool(before) and _word(before[-1])
        folded = fold(text)
        hit = self._earliest(self._hits(folded.text, after_word, not final))
        match = None if hit is None else _matched(folded, hit)
        if final:
            return match, len(text)
        start = self._open_start(folded.text, after_word)
        return match, folded.origin(start) if start < len(folded.text) else len(text)


class StreamScanner:
    """Checks an answer as it streams, so a term split across two chunks is caught,
    while holding back as little text as it can."""

    def __init__(self, terms: TermList) -> None:
        self._terms = terms
        self._held = ""
        self._before = ""
        self._offset = 0
        self._match: Match | None = None

    @property
    def held(self) -> int:
        """Characters held back now."""
        return len(self._held)

    def feed(self, text: str) -> tuple[str, Match | None]:
        """Appends ``text``: the text safe to release now, and a match or None. After
        a match every call answers ("", that match)."""
        if self._match is not None:
            return "", self._match
        if self._terms.empty:
            self._offset += len(text)
            return text, None
        return self._check(self._held + text, final=False)

    def finish(self, text: str) -> tuple[str, Match | None]:
        """The last ``text`` and the end of the stream (``""``: the end alone): what
        was held and ``text``, or the text before a match in them."""
        if self._match is not None:
            return "", self._match
        return self._check(self._held + text, final=True)

    def _check(self, text: str, final: bool) -> tuple[str, Match | None]:
        match, hold = self._terms._decide(self._before, text, final)
        if match is not None:
            return self._stop(text, match)
        return self._release(text, hold), None

    def _stop(self, text: str, match: Match) -> tuple[str, Match]:
        self._match = replace(match, start=match.start + self._offset,
                              end=match.end + self._offset)
        self._held = ""
        return text[:match.start], self._match

    def _release(self, text: str, hold: int) -> str:
        released, self._held = text[:hold], text[hold:]
        if released:
            self._offset += len(released)
            keep = self._terms._context
            self._before = (self._before + released[-keep:])[-keep:]
        return released


def _order(match: Match) -> tuple[int, int, str, str]:
    return match.start, match.end, match.category, match.term


def _word(char: str) -> bool:
    return char.isalnum() or (not char.isascii() and unicodedata.category(char)[0] == "M")


def _clear_before(norm: str, start: int, after_word: bool) -> bool:
    return not after_word if start == 0 else not _word(norm[start - 1])


def _listed(category: str, values: Iterable[str], kind: str) -> list[str]:
    if isinstance(values, str):
        raise ValueError(f"safety list {category!r}: {kind}s must be a list of strings, "
                         f"not the string {values!r}")
    return list(values)


def _automaton(terms: Mapping[str, Iterable[str]]) -> tuple[Any, int]:
    """One automaton for every term (None where there are none), and the longest."""
    automaton = ahocorasick.Automaton()
    longest = 0
    for category in sorted(terms):
        for term in _listed(category, terms[category], "term"):
            key = fold(term).text.strip()
            if not key:
                raise ValueError(f"safety list {category!r}: empty term {term!r}")
            if key not in automaton:
                automaton.add_word(key, _Entry(len(key), category, term))
                longest = max(longest, len(key))
    if not longest:
        return None, 0
    automaton.make_automaton()
    return automaton, longest


def _compile_all(patterns: Mapping[str, Iterable[str]]) -> tuple[_Pattern, ...]:
    return tuple(_Pattern(category, source, _compile(category, source),
                          regex_module.compile(source, regex_module.IGNORECASE))
                 for category in sorted(patterns)
                 for source in _listed(category, patterns[category], "pattern"))


def _compile(category: str, source: str) -> re.Pattern[str]:
    try:
        regex = re.compile(source, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"safety list {category!r}: pattern {source!r} does not compile: "
                         f"{exc}") from exc
    if any(m.start() == m.end() for probe in _PROBES for m in regex.finditer(probe)):
        raise ValueError(f"safety list {category!r}: pattern {source!r} can match "
                         f"the empty string")
    return regex


def _every(pattern: _Pattern, text: str, pos: int = 0) -> Iterator[Match]:
    for m in pattern.regex.finditer(text, pos):
        if m.end() > m.start():
            yield Match(pattern.category, pattern.source, m.start(), m.end())


def _first(pattern: _Pattern, text: str) -> Match | None:
    return next(_every(pattern, text), None)


def _decide_pattern(pattern: _Pattern, before: str, text: str,
                    final: bool) -> tuple[Match | None, int]:
    """A stream's pattern match that later text cannot change, or None and where
    the text to hold begins: where a partial match at the end begins (what more
    text could make a match), or a match that touches the end; never more than
    the last PATTERN_SPAN - 1 characters. One scan of the ``regex`` module
    finds both the matches and the partial one."""
    base = len(before)
    hold = len(text)
    for m in pattern.partial.finditer(before + text, base, partial=not final):
        start, end = m.start() - base, m.end() - base
        if end == start:
            continue
        if m.partial:
            hold = start
            break
        if final or end < len(text):
            return Match(pattern.category, pattern.source, start, end), len(text)
        if end - start <= PATTERN_SPAN:  # touches the end: more text may change it
            hold = start
            return None, hold
        break
    if final:
        return None, len(text)
    return None, max(min(hold, len(text)), len(text) - PATTERN_SPAN + 1, 0)

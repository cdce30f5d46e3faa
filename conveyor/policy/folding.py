"""Text folded for level-1 terms (safety.py): lower case and compatibility forms,
runs of whitespace as one space, with every offset traceable to the original.

Text and terms are folded a character at a time, each character to its NFKC
compatibility form (fullwidth "ＫＩＬＬ", "①") and then to lower case, each step
kept only where it gives one character, so every offset in the folded text is one
in the original: "İ" (whose lower case is two characters) stays "İ", the ligature
"ﬁ" stays "ﬁ". Final sigma folds to σ. Plain ASCII text takes ``str.lower``
directly.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from dataclasses import dataclass

__all__ = ["Folded", "fold"]

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

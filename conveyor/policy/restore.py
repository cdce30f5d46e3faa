"""Personal data put back into an answer: the placeholders a
:class:`~conveyor.policy.pii.Redactor` made, replaced by their originals, in a
whole text or as it streams (a placeholder split across two chunks is held back
until it is whole, at most the longest placeholder's length - 1 characters).
Only exact placeholders of the mapping are restored: a model that alters one
(``<Email_1>``) leaves it as it wrote it, and a text that merely looks like a
placeholder is never given a value."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from typing import NamedTuple

__all__ = ["Restorer"]


class _Placeholders(NamedTuple):
    """What a restore needs to know of a mapping's placeholders, built once per set of
    placeholders: most requests have the same few (``<EMAIL_1>``, ``<PHONE_1>``)."""

    pattern: re.Pattern[str]
    longest: int
    prefixes: frozenset[str]
    first_chars: frozenset[str]


@lru_cache(maxsize=1024)
def _placeholders(keys: frozenset[str]) -> _Placeholders:
    longest_first = sorted(keys, key=lambda k: (-len(k), k))
    return _Placeholders(re.compile("|".join(map(re.escape, longest_first))),
                         max(map(len, keys)),
                         frozenset(p[:i] for p in keys for i in range(1, len(p))),
                         frozenset(p[0] for p in keys))


class Restorer:
    """Puts the originals back into an answer: whole, or as it streams.

    Only exact placeholders of ``mapping`` are replaced; anything else that looks like one
    is left as it is. :meth:`restore` is independent of the stream state.
    """

    def __init__(self, mapping: Mapping[str, str]) -> None:
        if any(not placeholder for placeholder in mapping):
            raise ValueError("a placeholder cannot be empty")
        self._mapping = dict(mapping)
        self._pattern: re.Pattern[str] | None = None
        self._longest = 0
        self._prefixes: frozenset[str] = frozenset()
        self._first_chars: frozenset[str] = frozenset()
        if self._mapping:
            self._pattern, self._longest, self._prefixes, self._first_chars = \
                _placeholders(frozenset(self._mapping))
        self._buffer = ""

    def idle_for(self, text: str) -> bool:
        """Nothing held, and no placeholder of the mapping can begin in ``text``:
        :meth:`feed` would give ``text`` back as it is."""
        return not self._buffer and not any(c in text for c in self._first_chars)

    @property
    def held(self) -> int:
        """How many characters :meth:`feed` holds back (at most the longest placeholder - 1)."""
        return len(self._buffer)

    def restore(self, text: str) -> str:
        """``text`` with every placeholder of the mapping replaced by its original."""
        if self._pattern is None:
            return text
        return self._pattern.sub(self._original, text)

    def feed(self, text: str) -> str:
        """The next chunk of a streamed answer: returns what is safe to send now, restored,
        and holds back a tail that could still become a placeholder of the mapping."""
        if self._pattern is None:
            return text
        buffer = self._buffer + text
        out, hold = self._split(buffer)
        self._buffer = buffer[hold:]
        return out

    def flush(self) -> str:
        """The end of the stream: what was held back, restored."""
        rest, self._buffer = self._buffer, ""
        return self.restore(rest)

    def _original(self, m: re.Match[str]) -> str:
        return self._mapping[m.group()]

    def _split(self, buffer: str) -> tuple[str, int]:
        """The restored text that is final, and where the held-back tail starts.

        A position is final when the text from it on is not a proper prefix of a
        placeholder: whatever follows, a placeholder cannot start there unless it is
        already whole in ``buffer``. Matches are taken in the order ``restore`` takes them.
        """
        assert self._pattern is not None
        parts: list[str] = []
        pos = 0
        hold = self._hold_start(buffer, 0)
        for m in self._pattern.finditer(buffer):
            if m.start() >= hold:
                break
            parts += (buffer[pos:m.start()], self._mapping[m.group()])
            pos = m.end()
            if pos > hold:
                hold = self._hold_start(buffer, pos)
        parts.append(buffer[pos:hold])
        return "".join(parts), hold

    def _hold_start(self, buffer: str, start: int) -> int:
        """The first position from ``start`` whose tail could still grow into a placeholder."""
        for i in range(max(start, len(buffer) - self._longest + 1), len(buffer)):
            if buffer[i] in self._first_chars and buffer[i:] in self._prefixes:
                return i
        return len(buffer)

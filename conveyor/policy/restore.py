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

__all__ = ["Restorer"]


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
        if self._mapping:
            keys = sorted(self._mapping, key=len, reverse=True)
            self._pattern = re.compile("|".join(map(re.escape, keys)))
        self._longest = max(map(len, self._mapping), default=0)
        self._prefixes = {p[:i] for p in self._mapping for i in range(1, len(p))}
        self._first_chars = {p[0] for p in self._mapping}
        self._buffer = ""

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

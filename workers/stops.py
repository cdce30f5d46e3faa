"""Stop strings in streamed text, found one way by the engines that stop on
them and by postprocess, which stops on them again for engines that cannot."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_stop", "held_tail"]


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in ``text`` begins (empty ones ignored), or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def held_tail(text: str, stops: Sequence[str]) -> int:
    """The length of the longest tail of ``text`` that begins some stop string:
    what must be held back until the next piece says whether it stops."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best

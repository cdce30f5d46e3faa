"""Ratings in the usage ledger: ``conveyor.feedback`` counted per tenant, model
and deployment by day, a request's latest rating once and exactly once across
crashes (docs/decisions/0002-faust-on-the-cold-path-only.md). :class:`Ratings`
needs only a mutable mapping."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from workers.usage.rows import bucket_start, expires_at, is_expired

__all__ = ["LATEST", "RatingKey", "RatingCounts", "Ratings", "RatingDim"]

RatingDim = Literal["tenant", "model", "deployment"]
# the key prefix of a request's latest rating; a row's key is a JSON array ("[...")
LATEST = "latest:"


@dataclass(frozen=True)
class RatingKey:
    day_ms: int
    tenant: str
    dim: RatingDim
    ident: str = ""

    def text(self) -> str:
        return json.dumps([self.day_ms, self.tenant, self.dim, self.ident],
                          separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> RatingKey:
        day_ms, tenant, dim, ident = json.loads(text)
        return cls(int(day_ms), tenant, dim, ident)

    @property
    def expires_ms(self) -> int:
        return expires_at(self.day_ms, "day")


@dataclass(frozen=True)
class RatingCounts:
    count: int = 0
    score_sum: float = 0.0

    @property
    def mean(self) -> float | None:
        return round(self.score_sum / self.count, 4) if self.count else None

    def plus(self, count: int, score: float) -> RatingCounts:
        return RatingCounts(self.count + count, round(self.score_sum + score, 6))

    def value(self, partition: int, offset: int) -> dict[str, Any]:
        return {"n": self.count, "s": self.score_sum, "p": partition, "o": offset}

    @classmethod
    def from_value(cls, value: Any) -> RatingCounts:
        return cls(int(value["n"]), float(value["s"]))


def _keys(tenant: str, day_ms: int, model: str, answered_by: str) -> list[RatingKey]:
    return [RatingKey(day_ms, tenant, "tenant"), RatingKey(day_ms, tenant, "model", model),
            RatingKey(day_ms, tenant, "deployment", answered_by)]


class Ratings:
    """Counts Feedback events into ``table``: rows (row key text -> row value)
    and the latest rating of each request (``LATEST + request id`` -> what it
    counted)."""

    def __init__(self, table: MutableMapping[str, Any], clock: Callable[[], int]) -> None:
        self.table = table
        self.clock = clock
        self.dirty: set[str] = set()

    def rows(self) -> Iterator[tuple[str, Any]]:
        """Every row: (key text, value)."""
        for text, value in list(self.table.items()):
            if not text.startswith(LATEST):
                yield text, value

    def count(self, feedback: Any, partition: int, offset: int) -> bool:
        """Count ``feedback`` read at ``offset``; False when it was counted before
        (a replay) or is older than the request's latest."""
        rid = feedback["request_id"]
        held = self.table.get(LATEST + rid)  # what the request's latest rating counted
        if held is not None and (held["p"], held["o"]) >= (partition, offset):
            return False
        day = bucket_start(int(feedback["ts_ms"]), "day")
        if is_expired(day, "day", self.clock()):
            return False
        score = float(feedback["score"])
        deltas: dict[RatingKey, tuple[int, float]] = {}
        if held is not None:  # the request's earlier rating leaves its rows
            for key in _keys(held["t"], held["d"], held["m"], held["a"]):
                deltas[key] = (-1, -float(held["s"]))
        for key in _keys(feedback["tenant"], day, feedback["model"],
                         feedback.get("answered_by") or ""):
            n, s = deltas.get(key, (0, 0.0))
            deltas[key] = (n + 1, s + score)
        for key, (n, s) in deltas.items():
            self._apply(key, n, s, partition, offset)
        # after its rows, in the same changelog: see the module's docstring
        self.table[LATEST + rid] = {"t": feedback["tenant"], "d": day, "m": feedback["model"],
                                    "a": feedback.get("answered_by") or "", "s": score,
                                    "p": partition, "o": offset}
        return True

    def _apply(self, key: RatingKey, count: int, score: float, partition: int,
               offset: int) -> None:
        """One row changed by one event, once: its position says whether it was."""
        text = key.text()
        row = self.table.get(text)
        if row is not None and (row["p"], row["o"]) >= (partition, offset):
            return  # applied before a crash; the app replays the event
        before = RatingCounts.from_value(row) if row is not None else RatingCounts()
        self.table[text] = before.plus(count, score).value(partition, offset)
        self.dirty.add(text)

    def sweep(self) -> int:
        """Drop rows and latest ratings past their retention; how many."""
        now = self.clock()
        gone = [text for text, held in list(self.table.items())
                if (is_expired(int(held["d"]), "day", now) if text.startswith(LATEST)
                    else RatingKey.parse(text).expires_ms <= now)]
        for text in gone:
            del self.table[text]
            self.dirty.discard(text)
        return len(gone)

    def take_dirty(self) -> set[str]:
        dirty, self.dirty = self.dirty, set()
        return dirty

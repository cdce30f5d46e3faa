"""Ratings in the usage ledger: ``conveyor.feedback`` counted per tenant, per
model asked for and per deployment that answered, by day.

* **A request's latest rating counts**, once. Rating again moves the request's
  rating: its earlier score leaves the rows it was in (the day it was given,
  its model and deployment) and the new one enters the rows of its own day.
  So a client that rates an answer ten times weighs as one rating.
* **What a rating is joined to** came with it: the gateway read the model
  asked for, the model that answered (a canary's deployment or a fallback)
  and the latency from the log when the rating came (gateway/feedback.py). A
  rating of an answer that had not ended counts under ``answered_by`` "".
* **Exactly once across crashes**, as the usage counts (workers/usage/counting.py):
  each row keeps the position of the last event applied to it, so an event
  the app replays after a SIGKILL leaves alone the rows it already changed and
  completes the rest; the request's latest rating is written after its rows,
  so a replay finds the earlier rating still there to take out.
* **Retention**: 400 days, as the usage by day; a request's latest rating is
  forgotten with it.

:class:`Ratings` only needs mutable mappings, so the rules are tested on dicts
and run on Faust tables unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from workers.usage.buckets import bucket_start, expires_at, is_expired

__all__ = ["RatingKey", "RatingCounts", "Ratings", "RatingDim"]

RatingDim = Literal["tenant", "model", "deployment"]


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
    """Counts Feedback events into ``totals`` (row key text -> row value), the
    latest of each request in ``latest`` (request id -> what it counted)."""

    def __init__(self, latest: MutableMapping[str, Any], totals: MutableMapping[str, Any],
                 clock: Callable[[], int]) -> None:
        self.latest = latest
        self.totals = totals
        self.clock = clock
        self.dirty: set[str] = set()

    def count(self, feedback: Any, partition: int, offset: int) -> bool:
        """Count ``feedback`` read at ``offset``; False when it was counted before
        (a replay) or is older than the request's latest."""
        rid = feedback["request_id"]
        held = self.latest.get(rid)
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
        self.latest[rid] = {"t": feedback["tenant"], "d": day, "m": feedback["model"],
                            "a": feedback.get("answered_by") or "", "s": score,
                            "p": partition, "o": offset}
        return True

    def _apply(self, key: RatingKey, count: int, score: float, partition: int,
               offset: int) -> None:
        """One row changed by one event, once: its position says whether it was."""
        text = key.text()
        row = self.totals.get(text)
        if row is not None and (row["p"], row["o"]) >= (partition, offset):
            return  # applied before a crash; the app replays the event
        before = RatingCounts.from_value(row) if row is not None else RatingCounts()
        self.totals[text] = before.plus(count, score).value(partition, offset)
        self.dirty.add(text)

    def sweep(self) -> int:
        """Drop rows and latest ratings past their retention; how many."""
        now = self.clock()
        dropped = 0
        for text in list(self.totals):
            if RatingKey.parse(text).expires_ms <= now:
                del self.totals[text]
                self.dirty.discard(text)
                dropped += 1
        for rid, held in list(self.latest.items()):
            if is_expired(int(held["d"]), "day", now):
                del self.latest[rid]
                dropped += 1
        return dropped

    def take_dirty(self) -> set[str]:
        dirty, self.dirty = self.dirty, set()
        return dirty

"""The rows of the usage ledger: what is counted, and under which key.

A row is one (granularity, bucket, dimension, tenant, id) with four counts;
the dimensions are the tenant, one of its API keys and one model it used.
Every row carries the tenant, so it lives in the partition of the tenant's
usage events. Months are counted for the tenant alone (the monthly quota).

Rows are plain tables with the bucket start in the key, not Faust's windowed
tables: the mirror and the sweep read the key alone, retention is a
comparison, and the value carries the position of the last event counted in
it (workers/usage/counting.py). A key is the JSON text of ``[by, dim,
bucket_ms, tenant, id]`` (:meth:`RowKey.parse`), a value a small dict of
short names (:meth:`Counts.from_value`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from workers.usage.buckets import Granularity, bucket_start

__all__ = ["Dimension", "DIMENSIONS", "RowKey", "Counts", "rows_of"]

Dimension = Literal["tenant", "key", "model"]
DIMENSIONS: tuple[Dimension, ...] = get_args(Dimension)
_REPORTED: tuple[Granularity, ...] = ("minute", "day")


@dataclass(frozen=True)
class RowKey:
    by: Granularity
    dim: Dimension
    bucket_ms: int
    tenant: str
    ident: str = ""  # the key id or the model; "" for the tenant's own row

    def text(self) -> str:
        return json.dumps([self.by, self.dim, self.bucket_ms, self.tenant, self.ident],
                          separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> RowKey:
        by, dim, bucket_ms, tenant, ident = json.loads(text)
        return cls(by=by, dim=dim, bucket_ms=int(bucket_ms), tenant=tenant, ident=ident)


@dataclass(frozen=True)
class Counts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Counts) -> Counts:
        return Counts(self.requests + other.requests, self.errors + other.errors,
                      self.prompt_tokens + other.prompt_tokens,
                      self.completion_tokens + other.completion_tokens)

    def value(self, partition: int, offset: int) -> dict[str, int]:
        """The table value: the counts and the position of the last event in them."""
        return {"r": self.requests, "e": self.errors, "pt": self.prompt_tokens,
                "ct": self.completion_tokens, "p": partition, "o": offset}

    @classmethod
    def from_value(cls, value: Any) -> Counts:
        return cls(int(value["r"]), int(value["e"]), int(value["pt"]), int(value["ct"]))

    @classmethod
    def of(cls, record: Any) -> Counts:
        """What one UsageRecord adds to each of its rows."""
        return cls(requests=1, errors=1 if record["status"] == "error" else 0,
                   prompt_tokens=max(0, int(record["prompt_tokens"])),
                   completion_tokens=max(0, int(record["completion_tokens"])))


def rows_of(record: Any) -> list[RowKey]:
    """Every row one UsageRecord counts in: three dimensions by minute and by
    day, and the tenant's month."""
    at = int(record["finished_ms"])
    tenant = record["tenant"]
    keys: list[RowKey] = []
    for by in _REPORTED:
        start = bucket_start(at, by)
        keys.append(RowKey(by, "tenant", start, tenant))
        keys.append(RowKey(by, "key", start, tenant, record["key_id"]))
        keys.append(RowKey(by, "model", start, tenant, record["model"]))
    keys.append(RowKey("month", "tenant", bucket_start(at, "month"), tenant))
    return keys

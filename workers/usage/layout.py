"""Where the usage ledger lives in Redis: one layout, written by the mirror
(workers/usage/mirror.py), read by :class:`~workers.usage.ledger.UsageLedger`
and, for the two quota keys, by the rate limiter's admission script.

``P`` is ``settings.kafka.topic_prefix``; days and months are UTC; ``B`` is a
bucket start in epoch milliseconds.

- ``P:usage:<tenant>:day:<YYYY-MM-DD>``: STRING, the tenant's prompt plus
  completion tokens of that day (an integer). Read by the quota check.
- ``P:usage:<tenant>:month:<YYYY-MM>``: STRING, the same for the month.
- ``P:usage:<tenant>:by-minute:<B>`` and ``P:usage:<tenant>:by-day:<B>``:
  HASH, one field per row of that bucket: ``tenant`` (the tenant's own
  total), ``key:<key id>`` and ``model:<model>``; each value is
  ``"<requests> <errors> <prompt tokens> <completion tokens>"``.

- ``P:ratings:<tenant>:by-day:<B>``: HASH, the ratings of that day
  (workers/usage/ratings.py): ``tenant``, ``model:<model asked for>`` and
  ``deployment:<model that answered>``; each value is ``"<count> <score sum>"``.

Every key is written whole with SET/HSET (never INCR), so writing it again
is harmless and a lost Redis is rebuilt by the next mirror pass. Every key
expires with its bucket (``PXAT``/``PEXPIREAT`` at bucket start plus the
retention of workers/usage/buckets.py), so Redis holds what the ledger holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.usage.buckets import Granularity, day_label, month_label
from workers.usage.ratings import RatingCounts
from workers.usage.rows import Counts

__all__ = ["UsageKeys", "encode_counts", "decode_counts", "encode_ratings", "decode_ratings"]


@dataclass(frozen=True)
class UsageKeys:
    prefix: str

    def quota(self, tenant: str, period: Granularity, at_ms: int) -> str:
        """The quota total of the day or month that holds ``at_ms``."""
        if period == "day":
            return f"{self.prefix}:usage:{tenant}:day:{day_label(at_ms)}"
        if period == "month":
            return f"{self.prefix}:usage:{tenant}:month:{month_label(at_ms)}"
        raise ValueError(f"no quota total by {period}")

    def bucket(self, tenant: str, by: Granularity, bucket_ms: int) -> str:
        """The hash of one minute or day of a tenant."""
        return f"{self.prefix}:usage:{tenant}:by-{by}:{bucket_ms}"

    @staticmethod
    def field(dim: str, ident: str = "") -> str:
        return "tenant" if dim == "tenant" else f"{dim}:{ident}"

    def ratings(self, tenant: str, day_ms: int) -> str:
        """The hash of one day's ratings of a tenant."""
        return f"{self.prefix}:ratings:{tenant}:by-day:{day_ms}"


def encode_counts(counts: Counts) -> str:
    return (f"{counts.requests} {counts.errors} {counts.prompt_tokens} "
            f"{counts.completion_tokens}")


def encode_ratings(counts: RatingCounts) -> str:
    return f"{counts.count} {counts.score_sum}"


def decode_ratings(text: str | bytes) -> RatingCounts:
    raw = text.decode() if isinstance(text, bytes) else text
    count, score_sum = raw.split()
    return RatingCounts(int(count), float(score_sum))


def decode_counts(text: str | bytes) -> Counts:
    raw = text.decode() if isinstance(text, bytes) else text
    requests, errors, prompt, completion = (int(v) for v in raw.split())
    return Counts(requests, errors, prompt, completion)

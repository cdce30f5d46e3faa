"""The figures the console draws: the overview's charts, on the server as SVG
bars (no script, no library), one chart a figure of a model over the last
hour, one bar a minute, from the accounting app's model-wide minute rows
(:meth:`workers.usage.ledger.UsageLedger.model_minutes`); and the fleet's
routing lately, from the request index and the workers' heartbeats."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from workers.usage.ledger import ModelMinute
from workers.usage.requests import RequestRow
from workers.usage.rows import MINUTE_MS

__all__ = ["Bar", "Chart", "ModelCharts", "ModelRouting", "PoolHits", "model_charts",
           "minute_starts", "prefix_hits_by_pool", "routing_by_model"]

WIDTH = 240.0
HEIGHT = 48.0
_SECONDS = MINUTE_MS / 1000  # a minute's


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    series: int  # 0: the figure, or a p50; 1: a p99 behind it
    title: str  # what a pointer or a screen reader is told of this minute


@dataclass(frozen=True)
class Chart:
    title: str
    summary: str  # the chart in words: its last minute and its highest
    bars: list[Bar]
    width: float = WIDTH
    height: float = HEIGHT


@dataclass(frozen=True)
class ModelCharts:
    model: str
    requests: int
    errors: int
    charts: list[Chart]


def minute_starts(until_ms: int, minutes: int) -> list[int]:
    """The starts of the ``minutes`` whole and current minutes up to ``until_ms``."""
    last = until_ms - until_ms % MINUTE_MS
    return [last - MINUTE_MS * i for i in range(minutes - 1, -1, -1)]


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "none"
    number = f"{value:,.1f}" if value < 100 and value != int(value) else f"{value:,.0f}"
    return f"{number} {unit}" if unit else number


def _chart(title: str, unit: str, starts: Sequence[int],
           series: Sequence[dict[int, float | None]], label: Callable[[int], str]) -> Chart:
    """Bars of one or two series over ``starts``; the second (drawn behind,
    lighter) is the higher one, as a p99 beside its p50."""
    values = [v for one in series for v in one.values() if v is not None]
    top = max(values, default=0.0) or 1.0
    step = WIDTH / max(1, len(starts))
    bars: list[Bar] = []
    for order in reversed(range(len(series))):
        for i, start in enumerate(starts):
            value = series[order].get(start)
            if value is None or value <= 0:
                continue
            height = max(1.0, HEIGHT * value / top)
            bars.append(Bar(x=round(i * step, 2), y=round(HEIGHT - height, 2),
                            width=round(max(1.0, step - 1), 2), height=round(height, 2),
                            series=order, title=f"{label(start)}: {_figure(value, unit)}"))
    last = [one.get(starts[-1]) for one in series] if starts else []
    summary = (f"{title}: last minute {' / '.join(_figure(v, unit) for v in last)}; "
               f"highest {_figure(max(values, default=None), unit)}")
    return Chart(title, summary, bars)


def model_charts(minutes: dict[str, list[ModelMinute]], starts: Sequence[int],
                 label: Callable[[int], str]) -> list[ModelCharts]:
    """Each model's four charts over ``starts`` (requests/s, TTFT p50 and p99,
    tokens/s, errors a minute), the busiest model first."""
    shown: list[ModelCharts] = []
    for model, rows in minutes.items():
        def of(pick: Callable[[ModelMinute], float | None],
               rows: list[ModelMinute] = rows) -> dict[int, float | None]:
            return {row.bucket_start_ms: pick(row) for row in rows}

        charts = [
            _chart("Requests/s", "/s", starts, [of(lambda r: r.requests / _SECONDS)], label),
            _chart("Time to first token, p50 and p99", "ms", starts,
                   [of(lambda r: r.ttft_p50_ms), of(lambda r: r.ttft_p99_ms)], label),
            _chart("Tokens/s", "/s", starts, [of(lambda r: r.completion_tokens / _SECONDS)],
                   label),
            _chart("Errors a minute", "", starts, [of(lambda r: float(r.errors))], label),
        ]
        shown.append(ModelCharts(model, sum(r.requests for r in rows),
                                 sum(r.errors for r in rows), charts))
    shown.sort(key=lambda m: (-m.requests, m.model))
    return shown


@dataclass
class ModelRouting:
    model: str
    requests: int = 0
    completed: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # error code -> how many
    # the model asked for -> how many this model answered for it (a fallback, a deployment)
    answered_for: Counter[str] = field(default_factory=Counter)
    ttfts_ms: list[int] = field(default_factory=list)

    @property
    def ttft_p50_ms(self) -> float | None:
        return median(self.ttfts_ms) if self.ttfts_ms else None


def routing_by_model(rows: Iterable[RequestRow]) -> list[ModelRouting]:
    """Each model's requests among ``rows``: how many completed, how many ended
    in each error code (a request refused before any worker took it has no
    model name when no layer read one), how many it answered for another model
    (as a fallback or a canary's deployment), and the median time to first
    token; the busiest first."""
    by: dict[str, ModelRouting] = {}
    for row in rows:
        seen = by.setdefault(row.model, ModelRouting(row.model))
        seen.requests += 1
        if row.status == "completed":
            seen.completed += 1
        else:
            seen.errors[row.error_code or "unknown"] += 1
        if row.asked_model:
            seen.answered_for[row.asked_model] += 1
        if row.first_token_ms is not None:
            seen.ttfts_ms.append(row.first_token_ms - row.entered_ms)
    return sorted(by.values(), key=lambda m: (-m.requests, m.model))


@dataclass(frozen=True)
class PoolHits:
    pool: str
    workers: int
    queries: int  # prompts whose prefix the workers looked up in their KV cache
    hits: int

    @property
    def rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


def prefix_hits_by_pool(workers: Iterable[dict[str, Any]]) -> list[PoolHits]:
    """Each pool's live workers' prefix-cache lookups and hits, summed from
    their heartbeats (a worker without a KV cache report counts none)."""
    pools: dict[str, list[dict[str, Any]]] = {}
    for row in workers:
        if row["live"]:
            pools.setdefault(row["pool"], []).append(row)
    return [PoolHits(pool, len(rows), sum((r["kv"] or {}).get("prefix_queries", 0) for r in rows),
                     sum((r["kv"] or {}).get("prefix_hits", 0) for r in rows))
            for pool, rows in sorted(pools.items())]

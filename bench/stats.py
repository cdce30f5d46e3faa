"""Percentiles, target checks and Markdown tables for the benchmark reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Check", "check_table", "fmt", "markdown_table", "ms", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def fmt(value: float, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, ``-`` when missing (NaN)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with one decimal, ``-`` when missing."""
    return fmt(seconds * 1000)


@dataclass(frozen=True)
class Check:
    """One measured figure against its target."""

    scenario: str
    label: str
    value: float
    limit: float
    op: Literal["<=", ">="]
    unit: str

    @property
    def met(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def measured(self) -> str:
        return "-" if math.isnan(self.value) else f"{self.value:.1f} {self.unit}"

    def target(self) -> str:
        return f"{self.op} {self.limit:g} {self.unit}"

    def line(self) -> str:
        verdict = "met" if self.met else "MISSED"
        return f"{self.label}: {self.measured()} (target {self.target()}: {verdict})"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(r) for r in rows)])


def check_table(checks: Sequence[Check]) -> str:
    """The checks as a Markdown table: each figure against its target."""
    return markdown_table(["scenario", "figure", "measured", "target", "met"],
                          [[k.scenario, k.label, k.measured(), k.target(),
                            "yes" if k.met else "no"] for k in checks])

"""The concurrent scenarios of a comparison: each round pair's rate, and the
sides taking turns at going first."""

from __future__ import annotations

import asyncio

from bench.client import Sample
from bench.compare import Scenario, Side, median_interval, run_rounds


class Counting(Side):
    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.sent, self.order = name, 0, order

    async def one(self, paced: bool) -> Sample:
        self.sent += 1
        self.order.append(self.name)
        await asyncio.sleep(0.001)
        return Sample(0.001, 0.001, 4)


def test_every_round_records_its_rate() -> None:
    rounds = 3
    sc = Scenario("c4-unpaced", "", 4, False, 1, 4 * 2 * rounds, 60.0, 2)
    order: list[str] = []
    result = asyncio.run(run_rounds(sc, Counting("a", order), Counting("b", order)))
    assert len(result.base.round_rates) == len(result.variant.round_rates) == rounds
    assert all(r > 0 for r in result.rate_ratios())


def test_which_side_goes_first_alternates() -> None:
    sc = Scenario("c1-paced", "", 1, True, 0, 4, 60.0)
    order: list[str] = []
    result = asyncio.run(run_rounds(sc, Counting("a", order), Counting("b", order)))
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(result.pairs) == 4 and result.added_ttft() == [0.0] * 4


def test_the_median_interval_needs_ten_values_and_holds_the_median() -> None:
    assert all(x != x for x in median_interval([1.0] * 9))  # NaN
    low, high = median_interval([float(i) for i in range(100)])
    assert low < 49.5 < high and (low, high) == (40.0, 60.0)

"""The c=32 share of a comparison: each round pair's ratio, and their median
with its interval beside the ratio of the totals."""

from __future__ import annotations

import asyncio

from bench.client import Sample
from bench.compare import cpu_rows, paired_checks, run_rounds
from bench.scenarios import Result, Scenario, Side


def test_the_share_is_the_median_of_the_round_pairs_ratios() -> None:
    result = Result(Scenario("c32-unpaced", "", 32, False, 0, 100, 1.0))
    # the machine drifts: the whole run's ratio of totals is pulled by one slow pair
    result.base.round_rates = [100.0] * 11 + [300.0]
    result.variant.round_rates = [97.0] * 11 + [150.0]
    result.base.busy_s = result.variant.busy_s = 1.0
    result.base.samples = [Sample(0.01, 0.02, 4)] * 400
    result.variant.samples = [Sample(0.01, 0.02, 4)] * 320
    assert result.rate_ratios()[:2] == [0.97, 0.97]
    total, paired = paired_checks("plain", "policed", 1.0, 0.95)(result)
    assert not total.met  # 320 against 400: 80 %
    assert paired.value == 97.0 and paired.met
    assert "median of 12 round pairs (95 % interval" in paired.label


class Counting(Side):
    def __init__(self, name: str) -> None:
        self.name, self.sent = name, 0

    async def one(self, paced: bool) -> Sample:
        self.sent += 1
        await asyncio.sleep(0.001)
        return Sample(0.001, 0.001, 4)


def test_every_round_records_its_rate() -> None:
    rounds = 3
    sc = Scenario("c32-unpaced", "", 4, False, 1, 4 * 2 * rounds, 60.0, 2)
    base, variant = Counting("a"), Counting("b")
    result = asyncio.run(run_rounds(sc, base, variant))
    assert len(result.base.round_rates) == len(result.variant.round_rates) == rounds
    assert all(r > 0 for r in result.rate_ratios())


def test_each_side_is_billed_the_cpu_of_its_own_rounds() -> None:
    sc = Scenario("c32-unpaced", "", 2, False, 0, 2 * 2 * 4, 60.0, 2)
    base, variant = Counting("a"), Counting("b")
    clock = {"gateway": 0.0}

    def cpu() -> dict[str, float]:
        # the variant's requests cost the gateway twice what the base's do
        clock["gateway"] = 0.001 * base.sent + 0.002 * variant.sent
        return dict(clock)

    result = asyncio.run(run_rounds(sc, base, variant, cpu))
    [gateway, whole] = cpu_rows(result)
    assert gateway == ["gateway", "1000", "2000", "+1000"]
    assert whole[0] == "all"

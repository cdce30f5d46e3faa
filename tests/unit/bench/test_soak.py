"""bench.soak's reading of memory and its report."""

from __future__ import annotations

import os

import pytest

from bench.profile import Proc
from bench.soak import Soak, rss_mib


def test_rss_is_read_from_proc_and_a_gone_process_has_none() -> None:
    assert 1 < rss_mib(os.getpid()) < 100_000
    assert rss_mib(2 ** 22 + 12345) == 0.0


def test_growth_is_measured_from_a_fifth_of_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    run = Soak([Proc(1, "gateway")])
    for i in range(10):
        run.samples.append((10.0 * i, 100 * i, {1: 50.0 + (5 if i >= 2 else 0) + i * 0.1}))
    run.ok = 900
    run.report()
    out = capsys.readouterr().out
    assert "| 10 | 100 | 10.0 | 50 |" in out
    # after a fifth (sample 2: 55.2 MiB) to the end (55.9): the warm-up's 5 MiB is not growth
    assert "| gateway | 55 MiB | 56 MiB | +1 MiB |" in out

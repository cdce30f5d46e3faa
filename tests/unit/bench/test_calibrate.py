"""bench.calibrate's fits: the coefficients bench.fleet_sim takes (A, B, C)."""

from __future__ import annotations

import pytest

from bench.calibrate import fit


def test_a_quadratic_and_a_line_come_back_as_three_coefficients() -> None:
    points = [(float(t), 2e-3 * t * t + 5 * t + 70) for t in (64, 256, 512, 1024)]
    assert fit(points, 2) == pytest.approx([2e-3, 5, 70], rel=1e-6)
    line = [(p, 7.5 * p + 14) for p in (0.03, 0.12, 0.25, 0.5)]
    assert fit(line, 1) == pytest.approx([0.0, 7.5, 14], rel=1e-6, abs=1e-9)

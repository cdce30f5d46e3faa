"""TokenRecords' window: it widens while ticks run late and narrows back."""

from __future__ import annotations

from conveyor.settings import load_settings
from workers.infer.token_records import Stretch, TokenRecords
from workers.outputs import Sender


def test_late_ticks_widen_the_window_up_to_its_most() -> None:
    stretch = Stretch(66 / 40)
    for _ in range(50):
        stretch.woke(0.012, 0.040)  # 12 ms late on a 40 ms window
    assert stretch.factor == 66 / 40


def test_ticks_on_time_leave_it_or_bring_it_back() -> None:
    stretch = Stretch(66 / 40)
    for _ in range(50):
        stretch.woke(0.0005, 0.040)
    assert stretch.factor == 1.0
    for _ in range(50):
        stretch.woke(0.020, 0.040)
    for _ in range(100):
        stretch.woke(0.0, 0.040)
    assert stretch.factor == 1.0


def test_one_late_tick_is_not_enough() -> None:
    stretch = Stretch(66 / 40)
    stretch.woke(0.015, 0.040)  # 3 ms late on average: under a tenth of the window
    assert stretch.factor == 1.0


def test_the_window_is_coalesce_times_the_stretch() -> None:
    settings = load_settings(topic_prefix="tr", coalesce_ms=40, coalesce_max_ms=80)
    records = TokenRecords(settings, Sender.__new__(Sender), streams=lambda: 4)
    assert abs(records.window_s() - 0.030) < 1e-9
    records.stretch.factor = 2.0
    assert abs(records.window_s() - 0.060) < 1e-9
    fixed = TokenRecords(settings.replace(coalesce_max_ms=0), Sender.__new__(Sender))
    assert fixed.stretch.most == 1.0

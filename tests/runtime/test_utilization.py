"""UtilizationMeter on a hand-driven clock: busy time, and its share of the last window."""

from __future__ import annotations

import pytest

from kvstrata.runtime.utilization import UtilizationMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def busy_for(meter: UtilizationMeter, clock: Clock, seconds: float) -> None:
    with meter.measure():
        clock.now += seconds


def test_busy_seconds_accumulate_and_share_is_over_the_last_window():
    clock = Clock()
    meter = UtilizationMeter(window_s=1.0, clock=clock)
    for _ in range(10):              # 0.07 s forwards every 0.1 s: 70 % busy
        busy_for(meter, clock, 0.07)
        clock.now += 0.03
    assert meter.busy_s == pytest.approx(0.7)
    assert meter.utilization() == pytest.approx(0.7, abs=0.08)
    clock.now += 5.0                 # idle: the last window holds no forward at all
    assert meter.utilization() == 0.0
    assert meter.busy_s == pytest.approx(0.7)


def test_a_forward_that_raises_still_counts_and_share_never_exceeds_one():
    clock = Clock()
    meter = UtilizationMeter(window_s=1.0, clock=clock)
    with pytest.raises(RuntimeError), meter.measure():
        clock.now += 2.0
        raise RuntimeError("forward failed")
    assert meter.busy_s == pytest.approx(2.0)
    assert meter.utilization() == 1.0


def test_the_window_slides():
    clock = Clock()
    meter = UtilizationMeter(window_s=1.0, clock=clock)
    busy_for(meter, clock, 1.0)      # a busy second ...
    for _ in range(20):              # ... then two mostly idle ones (10 % busy)
        busy_for(meter, clock, 0.01)
        clock.now += 0.09
    assert meter.utilization() == pytest.approx(0.1, abs=0.02)

"""``sluice bench soak``'s pure pieces: the least-squares slope its pass flags read, and the options scaled
to a run's length (the retention and trim interval short enough to act many times in any run)."""

from __future__ import annotations

import pytest

from sluice.bench.soak import SoakOptions, slope_per_min


def test_slope_is_exact_on_a_line_and_per_minute() -> None:
    # 3 units a second is 180 a minute, whatever the offset and the spacing of the samples
    assert slope_per_min([(t, 7 + 3 * t) for t in (0.0, 1.0, 2.5, 10.0, 11.0)]) == pytest.approx(180.0)
    assert slope_per_min([(t, 5.0) for t in (0.0, 10.0, 20.0)]) == 0.0
    # a step up and back down is level: noise around a level gives a slope near 0, not its spread
    assert slope_per_min([(0.0, 1.0), (10.0, 3.0), (20.0, 1.0), (30.0, 3.0), (40.0, 1.0)]) == 0.0


def test_slope_needs_three_points_at_two_times() -> None:
    assert slope_per_min([]) is None
    assert slope_per_min([(0.0, 1.0), (1.0, 2.0)]) is None
    assert slope_per_min([(5.0, 1.0), (5.0, 2.0), (5.0, 3.0)]) is None


def test_options_scale_with_the_duration() -> None:
    full = SoakOptions.for_run("redis://x", quick=False)
    assert (full.duration_s, full.rate, full.followers, full.max_in_flight) == (3600.0, 15.0, 30, (32, 160))
    assert (full.retention_s, full.trim_interval_s, full.sample_every_s, full.idle_s) == (120, 60.0, 10.0, 90.0)
    five = SoakOptions.for_run("redis://x", quick=False, duration_s=300)
    assert (five.retention_s, five.trim_interval_s, five.sample_every_s, five.idle_s) == (50, 10.0, 10.0, 20.0)
    quick = SoakOptions.for_run("redis://x", quick=True)
    assert (quick.duration_s, quick.rate, quick.followers, quick.max_in_flight) == (30.0, 5.0, 5, (4, 16))
    assert (quick.retention_s, quick.trim_interval_s, quick.sample_every_s, quick.idle_s) == (5, 1.0, 1.0, 6.5)
    assert quick.scenario == "synthetic;deltas=10;pace_ms=100"
    given = SoakOptions.for_run("redis://x", quick=True, duration_s=60, rate=2, followers=0)
    assert (given.duration_s, given.rate, given.followers, given.retention_s) == (60, 2, 0, 10)


@pytest.mark.parametrize(("duration", "rate", "followers"), [(0, None, None), (10, 0, None), (10, None, -1)])
def test_options_refuse_nonsense(duration: float, rate: float | None, followers: int | None) -> None:
    with pytest.raises(ValueError, match="--duration and --rate must be positive"):
        SoakOptions.for_run("redis://x", quick=False, duration_s=duration, rate=rate, followers=followers)

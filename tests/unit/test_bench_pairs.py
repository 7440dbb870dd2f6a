"""The paired comparison of end-to-end runs (``sluice.bench.pairs``) and the rounds' order: exact pairs,
medians and order-statistic intervals from constructed runs, and the interval's coverage checked against the
binomial distribution it rests on."""

from __future__ import annotations

import argparse
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.bench.main import _e2e_options, configure_parser
from sluice.bench.pairs import median_interval, telemetry_costs


def _run(label: str, rnd: int, tel: str, us: float | None) -> dict[str, object]:
    return {
        "label": label + ("" if tel == "none" else f" telemetry={tel}"),
        "round": rnd,
        "telemetry": tel,
        "worker_cpu_us_per_event": us,
    }


def test_pairs_are_made_within_a_round_and_a_case() -> None:
    none = [10.0, 12.0, 11.0, 15.0, 9.0, 10.5, 13.0]
    admin = [10.5, 12.1, 11.4, 14.8, 9.6, 10.5, 13.2]
    runs = [_run("e2e n=100", i, "none", us) for i, us in enumerate(none)]
    runs += [_run("e2e n=100", i, "admin", us) for i, us in enumerate(admin)]
    # another case's runs and a run without its pair stay out of these pairs
    runs += [_run("e2e n=200", 0, "admin", 99.0), _run("e2e n=100", 7, "admin", 50.0)]
    runs += [_run("e2e n=100", 8, "none", None), _run("e2e n=100", 8, "admin", 50.0)]
    [cost] = telemetry_costs(runs[::-1])  # the runs' order does not matter: the rounds pair them
    diffs = [a - b for a, b in zip(admin, none, strict=True)]
    assert cost["case"] == "e2e n=100" and cost["telemetry"] == "admin" and cost["pairs"] == 7
    assert cost["diffs_us_per_event"] == diffs
    assert cost["median_diff_us_per_event"] == sorted(diffs)[3]
    assert cost["none_median_us_per_event"] == 11.0
    assert math.isclose(cost["median_diff_relative"], sorted(diffs)[3] / 11.0)
    # n = 7: P(B <= 0) = 1/128 <= 2.5 %, P(B <= 1) = 8/128 > 2.5 %: the extremes
    assert cost["interval_us_per_event"] == [min(diffs), max(diffs)]


def test_a_setting_without_none_runs_has_no_cost_and_few_pairs_have_no_interval() -> None:
    assert telemetry_costs([_run("e2e", 0, "admin", 1.0), _run("e2e", 1, "otlp", 2.0)]) == []
    runs = [_run("e2e", i, tel, float(i)) for i in range(5) for tel in ("none", "admin")]
    [cost] = telemetry_costs(runs)
    assert cost["pairs"] == 5 and cost["median_diff_us_per_event"] == 0.0 and cost["interval_us_per_event"] is None


def test_the_interval_is_the_sign_tests_order_statistics() -> None:
    xs = list(range(1, 13))  # n = 12: P(B <= 2) = 79/4096 <= 2.5 % < P(B <= 3) = 299/4096
    assert median_interval(xs) == (3, 10)
    assert median_interval(xs[:6]) == (1, 6)  # n = 6: P(B <= 0) = 1/64
    assert median_interval(xs[:5]) is None  # n = 5: P(B <= 0) = 1/32 > 2.5 %
    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 6.0]) == (1.0, 6.0)  # sorted first


@given(st.integers(6, 60))
def test_the_interval_covers_the_median_with_at_least_the_level(n: int) -> None:
    """For n values of a continuous population, the median lies outside [x(j), x(n+1-j)] exactly when j or
    fewer of the values are above it or j or fewer below: that chance, from the binomial, is at most 5 %."""
    ranks = median_interval(list(range(n)))
    assert ranks is not None
    j = int(ranks[0]) + 1  # the values are their own ranks (0-based)
    assert ranks[1] == n - j
    miss = 2 * sum(math.comb(n, k) for k in range(j)) / 2**n
    assert miss <= 0.05
    # and j is the largest such: one more order statistic inward would miss more often than 5 %
    assert 2 * sum(math.comb(n, k) for k in range(j + 1)) / 2**n > 0.05


def test_the_interval_holds_a_sampled_median_as_often_as_it_says() -> None:
    """An empirical check on samples of a skewed population whose median is known (exponential: ln 2)."""
    rng = random.Random(7)
    trials, hits = 4000, 0
    for _ in range(trials):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(12)]) or (0.0, 0.0)
        hits += low <= math.log(2) <= high
    assert hits / trials >= 0.95  # 96.1 % in theory for n = 12; 4,000 trials put the rate within ±0.6 %


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(["e2e", *argv])


def test_rounds_repeat_the_cases_in_abba_order_with_one_ceiling() -> None:
    opts = _e2e_options(_args("--telemetry", "none,admin", "--rounds", "4"), "redis://x", memory=False)
    assert [(o.round, o.telemetry) for o in opts] == [
        (0, "none"),
        (0, "admin"),
        (1, "admin"),
        (1, "none"),
        (2, "none"),
        (2, "admin"),
        (3, "admin"),
        (3, "none"),
    ]
    assert [o.ceiling for o in opts] == [True] + [False] * 7


def test_rounds_below_one_are_refused() -> None:
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        _e2e_options(_args("--rounds", "0"), "redis://x", memory=False)


def _side_by_side(rnd: int, none_us: float, admin_us: float) -> dict[str, object]:
    return {
        "label": "e2e n=200 telemetry=none|admin",
        "round": rnd,
        "telemetry": "none|admin",
        "worker_cpu_us_per_event": (none_us + admin_us) / 2,
        "sides": [
            {"telemetry": "admin", "worker_cpu_us_per_event": admin_us},
            {"telemetry": "none", "worker_cpu_us_per_event": none_us},
        ],
    }


def test_a_side_by_side_run_is_its_own_pair() -> None:
    none = [60.0, 70.0, 55.0, 65.0, 62.0, 58.0]
    admin = [61.0, 70.5, 57.0, 64.0, 63.5, 58.2]
    runs = [_side_by_side(i, n, a) for i, (n, a) in enumerate(zip(none, admin, strict=True))]
    # a separate run of the same size does not pair with the side-by-side ones
    runs.append(_run("e2e n=200", 0, "none", 10.0))
    [cost] = telemetry_costs(runs)
    assert cost["case"] == "e2e n=200 telemetry=none|admin" and cost["telemetry"] == "admin"
    assert cost["pairs"] == 6
    assert cost["diffs_us_per_event"] == [a - n for a, n in zip(admin, none, strict=True)]
    assert cost["interval_us_per_event"] == [-1.0, 2.0]  # n = 6: the extremes


def test_side_by_side_takes_none_and_one_setting() -> None:
    opts = _e2e_options(_args("--telemetry", "none|admin,none", "--rounds", "2"), "redis://x", memory=False)
    assert [(o.round, o.telemetry) for o in opts] == [(0, "none|admin"), (0, "none"), (1, "none"), (1, "none|admin")]
    for bad in ("admin|otlp", "none|admin|otlp", "none|bogus"):
        with pytest.raises(SystemExit, match="--telemetry"):
            _e2e_options(_args("--telemetry", bad), "redis://x", memory=False)

"""``sluice bench capacity --quick`` runs for real at small sizes (the fake provider and three workers as
processes on a real Redis). Asserted: the report's shape and the flags that do not depend on speed (the
provider's peak concurrency within the cap, no 429, every job completed); the timing figures are only
checked to be measured, never compared with their targets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import redis

from sluice.bench.main import configure_parser, run_from_args


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(list(argv))


def test_bench_capacity_quick(private_redis_url: str, tmp_path: Path) -> None:
    redis_url = private_redis_url  # the session's own server: see test_bench_quick.py's test_bench_e2e_tiny
    before = set(redis.Redis.from_url(redis_url).keys("sluice-bench:*"))  # other runs' leftovers are not ours
    out = tmp_path / "capacity.json"
    assert run_from_args(_args("capacity", "--quick", "--redis-url", redis_url, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "capacity" and doc["quick"] is True
    cap = doc["capacity"]
    assert (cap["cap"], cap["rpm"], cap["quick"]) == (20, None, True)
    assert set(cap) == {"quick", "cap", "rpm", "burst", "fairness", "unequal", "cost", "pass", "redis"}

    burst = cap["burst"]
    assert set(burst["pass"]) == {"peak_within_cap", "429_at_most_1pct", "all_completed", "throughput_90pct", "all"}
    assert burst["states"] == {"completed": 200} and burst["pass"]["all_completed"]
    assert 1 <= burst["peak_in_flight"] <= 20 and burst["pass"]["peak_within_cap"]
    assert burst["responses_429"] == 0 and burst["provider_requests"] == 200 and burst["pass"]["429_at_most_1pct"]
    assert burst["throughput_per_s"] > 0 and burst["throughput_over_cap"] == (
        burst["throughput_per_s"] / burst["cap_per_s"]
    )

    fair = cap["fairness"]
    assert fair["states"] == {"completed": 110} and fair["pass"]["all_completed"]
    assert fair["b_median_wait_ms_with_a"] >= 0 and fair["b_median_wait_ms_alone"] >= 0
    assert fair["ratio"] == fair["b_median_wait_ms_with_a"] / max(fair["b_median_wait_ms_alone"], 1.0)
    assert fair["peak_in_flight"] <= 20 and fair["responses_429"] == 0

    unequal = cap["unequal"]
    assert unequal["states"] == {"completed": 20} and unequal["pass"]["all_completed"]
    assert set(unequal["peak_leases"]) == {"2", "16"} and unequal["pass"]["leases_within_slots"]
    assert all(1 <= unequal["peak_leases"][k] <= int(k) for k in ("2", "16")), unequal["peak_leases"]
    assert sum(unequal["jobs_run"].values()) == 20
    assert unequal["makespan_over_ideal"] == unequal["makespan_s"] / unequal["ideal_s"]

    cost = cap["cost"]
    assert cost["states"] == {"completed": 1200} and cost["pass"]["all_completed"]  # 2 pairs of 3 runs of 200
    assert all(len(v) == 2 and min(v) > 0 for v in cost["cpu_us_per_request_all"].values())
    assert set(cost["pass"]) == {"limited_added_at_most_10pct", "budgeted_added_at_most_10pct", "all_completed", "all"}
    for name in ("limited", "budgeted"):  # the median of 2 pairs is their mean; too few for an interval
        diffs = [
            x - u
            for x, u in zip(
                cost["cpu_us_per_request_all"][name], cost["cpu_us_per_request_all"]["unlimited"], strict=True
            )
        ]
        assert cost[name]["added_us_per_request"] == sum(diffs) / 2 and cost[name]["interval_over_unlimited"] is None

    flags = [burst["pass"]["all"], fair["pass"]["all"], unequal["pass"]["all"], cost["pass"]["all"]]
    assert cap["pass"] == all(flags)
    assert set(redis.Redis.from_url(redis_url).keys("sluice-bench:*")) <= before  # every run cleaned up

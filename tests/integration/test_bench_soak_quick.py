"""``sluice bench soak --quick`` runs for real at small sizes (the fake provider, two workers of different
sizes and ``sluice relay`` as processes on a real Redis, followers over SSE). Asserted: the report's shape and
the flags that do not depend on speed or on a warm-up: every request terminal exactly once and completed,
every follow the whole log, the jobs stream bounded and empty after the idle spell, no process died. The
slopes are only checked to be computed; 30 seconds cannot tell a leak from a warm-up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import redis

from sluice.bench.main import configure_parser, run_from_args

REPORT_KEYS = {
    "quick", "duration_s", "rate_per_s", "followers", "scenario", "nominal_stream_s", "retention_seconds",
    "jobs_trim_interval", "sample_every_s", "idle_s", "load_s", "drained_at_s", "slope_window_s", "slope_samples",
    "thresholds", "requests", "followers_report", "processes", "redis", "died", "samples", "pass", "key_prefix",
    "max_in_flight", "redis_origin",
}  # fmt: skip
FLAGS = {
    "terminal_once", "all_completed", "followers_whole_logs", "jobs_stream_bounded", "no_process_died", "rss_level",
    "fds_level", "run_keys_level", "redis_memory_level", "all",
}  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(list(argv))


def test_bench_soak_quick(private_redis_url: str, tmp_path: Path) -> None:
    redis_url = private_redis_url  # the session's own server: see test_bench_quick.py's test_bench_e2e_tiny
    before = set(redis.Redis.from_url(redis_url).keys("sluice-bench:*"))  # other runs' leftovers are not ours
    out = tmp_path / "soak.json"
    assert run_from_args(_args("soak", "--quick", "--redis-url", redis_url, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "soak" and doc["quick"] is True
    soak = doc["soak"]
    assert set(soak) == REPORT_KEYS
    assert (soak["duration_s"], soak["rate_per_s"], soak["followers"]) == (30.0, 5.0, 5)
    assert (soak["retention_seconds"], soak["jobs_trim_interval"], soak["sample_every_s"]) == (5, 1.0, 1.0)
    assert soak["max_in_flight"] == {"worker-a": 4, "worker-b": 16} and soak["redis_origin"] == "given"

    q = soak["requests"]
    assert {k: q[k] for k in q if k != "enqueue_max_late_s"} == {
        "enqueued": 150,
        "terminal_entries": 150,
        "terminal_once": 150,
        "missing": 0,
        "more_than_once": 0,
        "unknown": 0,
        "states": {"completed": 150},
        "dead_letters": 0,
    }
    f = soak["followers_report"]
    follows = f["follows"]
    assert follows >= 5 and f["outcomes"] == {"whole log": follows} and f["short"] == []
    assert f["events"] == follows * f["expected_events_per_request"]

    red = soak["redis"]
    assert 0 < red["jobs_xlen_max"] <= red["jobs_xlen_bound"] == soak["thresholds"]["jobs_xlen_bound"]
    assert red["jobs_xlen_after_idle"] == 0 and red["terminal_xlen_after_idle"] == 150
    assert red["run_keys_max"] > 0 and red["used_memory_max_kib"] > 0 and red["terminal_bytes_per_entry"] > 0

    assert set(soak["processes"]) == {"worker-a", "worker-b", "relay", "fake-provider"}
    assert soak["slope_samples"] >= 10  # samples every second over the last 15 s of load
    for name, p in soak["processes"].items():
        assert p["judged"] == (name != "fake-provider")
        assert isinstance(p["rss_slope_kib_per_min"], float) and isinstance(p["fds_slope_per_min"], float)
        assert p["rss_kib"]["first"] > 0 and p["fds"]["max"] >= p["fds"]["first"] > 0 and p["cpu_s"] > 0
        if p["judged"]:
            assert p["exit_code"] == 0  # each stopped cleanly on SIGTERM
    assert soak["died"] == {}
    n = len(soak["samples"]["t"])
    assert all(len(v) == n for v in soak["samples"]["rss_kib"].values()) and len(soak["samples"]["redis"]) == n

    ok = soak["pass"]
    assert set(ok) == FLAGS
    assert ok["terminal_once"] and ok["all_completed"] and ok["followers_whole_logs"]
    assert ok["jobs_stream_bounded"] and ok["no_process_died"]
    assert ok["all"] == all(v for k, v in ok.items() if k != "all" and v is not None)
    assert set(redis.Redis.from_url(redis_url).keys("sluice-bench:*")) <= before  # the run cleaned up

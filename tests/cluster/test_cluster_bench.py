"""``sluice bench e2e --cluster`` runs for real at a tiny size on the session's cluster, both append paths.
Nothing about speed is asserted: only that each number comes from a run that did the whole job."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sluice.bench.main import configure_parser, run_from_args
from tests.cluster.harness import Cluster


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(list(argv))


def test_bench_e2e_on_the_cluster_both_append_paths(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    argv = [
        "e2e",
        "--quick",
        "--cluster",
        "--redis-url",
        cluster.seed_url,
        "--streams",
        "6",
        "--deltas",
        "30",
        "--cancel",
        "1",
        "--cluster-appends",
        "pipe,redis-py",
        "--durability",
        "replica",
        "--out",
        str(out),
    ]
    assert run_from_args(_args(*argv)) == 0
    runs = json.loads(out.read_text())["e2e"]
    assert [r["cluster_appends"] for r in runs] == ["pipe", "redis-py"]
    per_stream = 30 + 4  # stream.start, block.start, 30 deltas, block.stop, stream.done
    for r in runs:
        assert r["redis_cluster"] and r["job_shards"] == 3 and r["durability"] == "replica"
        assert "ceiling" not in r and "floor_client" not in r  # both write to one server
        con = r["consumer"]
        assert con["events"] == r["events"] == 6 * per_stream and con["terminals"] == {"completed": 6}
        assert con["latency_us"]["count"] == 6 * 30
        assert r["raw_entries"] == 6 * (r["expected_provider_events_per_stream"] + 1)
        # every node's CPU is summed: six nodes, and the masters ran the appends
        assert len(r["redis_cpu_util_by_node"]) == 6 and r["redis_cpu_us_per_event"] > 0
        assert r["redis_bytes_per_event"] > 0 and r["redis_memory_sample_requests"] == 6
        assert r["cancel"]["streams"] == 1

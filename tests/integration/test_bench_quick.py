"""``sluice bench`` runs for real at tiny sizes: part 1 exactly as ``--quick``, parts 2 and 3 with the fake
provider, a worker and the consumer as separate processes on a real Redis. Nothing about speed is
asserted: only that every number comes out of a measurement that did the whole job."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import time
from pathlib import Path

import pytest
import redis

from sluice.bench.consumer import read_streams
from sluice.bench.floor_client import floor_key
from sluice.bench.main import configure_parser, run_from_args
from sluice.bench.redis_ceiling import throttled, xadd_ceiling_redispy, xadd_ceiling_resp
from sluice.harness.fake.render import DIALECTS, STAMP_PLACEHOLDER, Script, Text, render_tagged

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(list(argv))


def test_bench_quick_normalizer(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert run_from_args(_args("--quick", "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "normalizer" and doc["quick"] is True
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["python"]
    assert doc["normalizer"]["config"]["size_mb"] == 1.0
    rows = {d["dialect"]: d for d in doc["normalizer"]["dialects"]}
    assert set(rows) == set(DIALECTS)
    for dialect, d in rows.items():
        assert d["bytes"] >= 1_000_000 and d["sse_events"] > 1000 and d["contract_events"] > 1000
        has_sdk = (
            dialect != "gemini"
            and importlib.util.find_spec("anthropic" if dialect == "anthropic" else "openai") is not None
        )
        assert set(d["paths"]) == ({"sluice", "floor", "sdk"} if has_sdk else {"sluice", "floor"})
        for p in d["paths"].values():
            assert p["runs"] == 2 and len(p["cpu_all"]) == 2
            assert p["cpu_s"] == min(p["cpu_all"]) > 0 and p["wall_s"] == min(p["wall_all"]) > 0
            assert p["us_per_event"] == pytest.approx(p["cpu_s"] / d["sse_events"] * 1e6)
        floor = d["paths"]["floor"]
        assert d["ratios"]["sluice_over_floor"] == pytest.approx(d["paths"]["sluice"]["cpu_s"] / floor["cpu_s"])
        assert (d["ratios"]["sdk_over_sluice"] is not None) == has_sdk


def test_bench_e2e_tiny(private_redis_url: str, tmp_path: Path) -> None:
    # The session's own server: no other session's bench runs add keys under "sluice-bench:*" while this one
    # checks that it left none (the runs of one session are one after the other on its worker).
    redis_url = private_redis_url
    out = tmp_path / "e2e.json"
    profile = Path(__import__("sys").executable).with_name("py-spy").exists()
    argv = [
        "e2e",
        "--quick",
        "--streams",
        "4",
        "--deltas",
        "40",
        "--cancel",
        "2",
        "--ceiling-commands",
        "400",
        "--redis-url",
        redis_url,
        "--out",
        str(out),
        "--profile-dir",
        str(tmp_path),
    ]
    if profile:
        argv += ["--profile", "py-spy"]
    assert run_from_args(_args(*argv)) == 0
    (r,) = json.loads(out.read_text())["e2e"]
    con = r["consumer"]
    per_stream = 40 + 4  # stream.start, block.start, 40 deltas, block.stop, stream.done
    assert r["expected_contract_events_per_stream"] == per_stream
    assert con["events"] == r["events"] == 4 * per_stream and con["unfinished"] == 0
    assert con["terminals"] == {"completed": 4}
    assert r["raw_entries"] == 4 * (r["expected_provider_events_per_stream"] + 1)  # + the HTTP response record
    # Every delta carried the fake provider's send stamp back to the consumer.
    lat = con["latency_us"]
    assert lat["count"] == 4 * 40 and 0 < lat["p50"] <= lat["p99"] <= lat["max"] < 60e6
    assert con["first_delta_latency_us"]["count"] == 4
    assert r["events_per_s"] > 0 and r["worker_cpu_us_per_event"] > 0 and r["worker_cpu_s"] > 0
    # The fake provider's CPU beside it (it sent every event, so it cannot be zero).
    assert r["fake_provider_cpu_us_per_event"] > 0
    # Redis's own CPU over the run (INFO cpu): it ran every append, so it cannot be zero.
    assert r["redis_cpu_util"] > 0 and r["redis_cpu_us_per_event"] > 0
    # Per request: its CPU, and the commands Redis ran for it (each request's claim, finalize and publish
    # scripts at least, its job's ack, and XADDs of its own log inside the append script).
    assert r["worker_cpu_us_per_request"] > 0 and r["redis_cpu_us_per_request"] > 0
    calls = r["redis_calls_per_request"]
    assert calls["evalsha"] >= 3 and calls["xack"] >= 1 and calls["xadd"] >= per_stream
    assert r["rss_baseline_bytes"] > 0 and r["rss_peak_bytes"] >= r["rss_baseline_bytes"] // 2
    assert r["max_inflight_streams"] >= 1
    assert r["worker_exit_codes"] == [0]
    cancel = r["cancel"]
    assert cancel["streams"] == 2 and len(cancel["each_close_ms"]) == 2
    assert all(0 <= x < 30_000 for x in cancel["each_close_ms"] + cancel["each_terminal_ms"])
    methods = [c["method"] for c in r["ceiling"]]
    assert methods == ["redis-py asyncio pipeline", "hiredis-packed RESP, asyncio socket"]
    for c in r["ceiling"]:
        assert c["commands"] == 400 and c["streams"] == 1000 and c["xadd_per_s"] > 0 and c["cpu_s"] > 0
        assert c["payload_bytes"] == round(r["mean_event_bytes"])
    assert r["events_over_ceiling"] == pytest.approx(r["events_per_s"] / r["ceiling"][0]["xadd_per_s"])
    # The floor client read the same streams and appended one entry per provider event (checked in Redis).
    floor = r["floor_client"]
    assert floor["streams"] == 4 and floor["events"] == 4 * r["expected_provider_events_per_stream"]
    assert floor["end_markers"] == 4 and floor["cpu_us_per_event"] > 0
    # A consumer read the floor's streams while it ran: every raw event, each stream to its end marker, and
    # one latency per stamped delta (none from the unstamped framing events).
    assert floor["consumer"]["events"] == floor["events"] and floor["consumer"]["unfinished"] == 0
    assert floor["consumer"]["by_type"] == {"floor": floor["events"]}
    assert floor["consumer"]["terminals"] == {"end": 4}
    floor_lat = floor["latency_us"]
    assert floor_lat["count"] == 4 * 40 and 0 < floor_lat["p50"] <= floor_lat["p99"] <= floor_lat["max"] < 60e6
    assert floor["first_delta_latency_us"]["count"] == 4
    assert r["worker_over_floor_cpu"] == pytest.approx(r["worker_cpu_us_per_event"] / floor["cpu_us_per_event"])
    if profile:
        assert r["profile"]["tool"] == "py-spy" and r["profile"]["samples"] > 0
    # The run's keys are gone (its own prefix: other runs may share the server at the same time).
    assert r["key_prefix"].startswith("sluice-bench:")
    assert redis.Redis.from_url(redis_url).keys(r["key_prefix"] + "*") == []


def _stamped(dialect: str, deltas: int, t0_us: int) -> list[bytes]:
    """One stream's SSE events as the fake provider sends them with ``stamp=1``: delta ``k`` stamped
    ``t0_us + k``, summary events repeating the deltas' stamps in order."""
    stamps = [f"⏱{t0_us + k:016d}|".encode() for k in range(deltas)]
    texts = iter(stamps)
    script = Script(model="m", blocks=(Text(tuple(STAMP_PLACEHOLDER + f"w{k} " for k in range(deltas))),))
    out = []
    for tag, data in render_tagged(dialect, script):
        first, *rest = data.split(STAMP_PLACEHOLDER.encode())
        fill = iter([next(texts)] if tag == "text" else stamps)
        out.append((first + b"".join(next(fill) + part for part in rest)).rstrip(b"\r\n"))
    return out


def test_consumer_reads_floor_entries_to_their_end_markers(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    t0 = time.time_ns() // 1000 - 5_000_000  # sent "5 s ago": every latency is at least that
    streams = {
        floor_key(key_prefix, 0): _stamped("openai-responses", 3, t0),
        floor_key(key_prefix, 1): _stamped("anthropic", 2, t0 + 100),
    }
    # The Responses summaries repeat the deltas' stamps: the raw events hold more stamps than there are deltas.
    assert sum(e.count(STAMP_PLACEHOLDER[0].encode()) for e in streams[floor_key(key_prefix, 0)]) > 3
    normalized = f"{key_prefix}:{{req:x}}:events"
    try:
        for key, events in streams.items():
            for e in events:
                r.xadd(key, {"data": e})
            r.xadd(key, {"end": 1})
            r.xadd(key, {"data": f"⏱{t0:016d}|after the end".encode()})  # never read: the stream ended
        r.xadd(normalized, {"type": "block.delta", "event": f'{{"text": "⏱{t0:016d}|Hi"}}'.encode()})
        r.xadd(normalized, {"type": "stream.done", "event": b"{}"})
        got = read_streams(r, [*streams, normalized], deadline_s=30)
    finally:
        r.delete(*streams, normalized)
        r.close()
    raw = sum(len(e) for e in streams.values())
    assert got["unfinished"] == 0 and got["events"] == raw + 2
    assert got["by_type"] == {"floor": raw, "block.delta": 1, "stream.done": 1}
    assert got["terminals"] == {"end": 2, "completed": 1}
    lat = got["latency_us"]
    assert lat["count"] == 3 + 2 + 1 and lat["max"] >= lat["p50"] >= 5_000_000 - 101  # no stamp after t0 + 101
    assert got["first_delta_latency_us"]["count"] == 3


def test_bench_memory_mode_goes_through_the_throttle(redis_url: str, tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    argv = [
        "memory",
        "--streams",
        "3",
        "--deltas",
        "20",
        "--redis-delay-ms",
        "40",
        "--no-ceiling",
        "--redis-url",
        redis_url,
        "--out",
        str(out),
    ]
    assert run_from_args(_args(*argv)) == 0
    (r,) = json.loads(out.read_text())["memory"]
    assert r["redis_delay_ms"] == 40 and "ceiling" not in r and "cancel" not in r
    assert r["consumer"]["terminals"] == {"completed": 3}
    # Claim, at least one append, the final status and the ACK each wait 40 ms for Redis' answer.
    assert r["run_s"] >= 0.16
    assert r["rss_peak_bytes"] > 0 and "rss_peak_second_half_bytes" in r


def test_throttle_proxy_delays_replies_and_keeps_bytes(redis_url: str) -> None:
    async def go() -> tuple[float, bytes | None]:
        import redis.asyncio as aioredis

        async with throttled(redis_url, delay_ms=50) as proxy:
            r = aioredis.Redis.from_url(proxy.url)
            value = bytes(range(256)) * 1000
            await r.set("sluicetest:bench:proxy", value)
            t = time.perf_counter()
            got = await r.get("sluicetest:bench:proxy")
            took = time.perf_counter() - t
            await r.delete("sluicetest:bench:proxy")
            await r.aclose()
            assert got == value
            return took, got

    took, _ = asyncio.run(go())
    assert took >= 0.05


def test_throttle_proxy_caps_what_is_sent_to_redis(redis_url: str) -> None:
    async def go() -> float:
        import redis.asyncio as aioredis

        async with throttled(redis_url, delay_ms=0, bytes_per_s=1_000_000) as proxy:
            r = aioredis.Redis.from_url(proxy.url)
            await r.ping()
            t = time.perf_counter()
            await r.set("sluicetest:bench:proxy-rate", b"v" * 300_000)
            took = time.perf_counter() - t
            assert proxy.bytes_up >= 300_000
            await r.delete("sluicetest:bench:proxy-rate")
            await r.aclose()
            return took

    assert asyncio.run(go()) >= 0.25  # 300 kB at 1 MB/s


def test_ceilings_measure_and_clean_up(redis_url: str, key_prefix: str) -> None:
    async def go() -> list[dict[str, object]]:
        a = await xadd_ceiling_redispy(
            redis_url, f"{key_prefix}:ceil", streams=7, commands=50, payload=b"p" * 99, pipeline=16
        )
        b = await xadd_ceiling_resp(
            redis_url, f"{key_prefix}:ceil", streams=7, commands=50, payload=b"p" * 99, pipeline=16
        )
        return [a.to_json(), b.to_json()]

    for c in asyncio.run(go()):
        assert c["commands"] == 50 and c["payload_bytes"] == 99 and c["xadd_per_s"] > 0
        assert c["client_cpu_us_per_xadd"] > 0
    assert not redis.Redis.from_url(redis_url).keys(f"{key_prefix}:ceil:*")


def test_bench_e2e_with_telemetry_really_exports(redis_url: str, tmp_path: Path) -> None:
    """``--telemetry otlp``: the worker exports its spans and metrics over OTLP/HTTP to the fake provider's
    sink, so the run pays for telemetry as a deployment does."""
    out = tmp_path / "e2e.json"
    argv = [
        "e2e",
        "--quick",
        "--streams",
        "2",
        "--deltas",
        "20",
        "--cancel",
        "0",
        "--no-ceiling",
        "--no-floor-client",
        "--telemetry",
        "otlp",
        "--redis-url",
        redis_url,
        "--out",
        str(out),
    ]
    assert run_from_args(_args(*argv)) == 0
    (r,) = json.loads(out.read_text())["e2e"]
    assert r["telemetry"] == "otlp" and r["consumer"]["terminals"] == {"completed": 2}
    assert r["otlp_exports"] >= 2  # at least the spans and the metrics, flushed when the worker stopped


def test_bench_e2e_side_by_side_splits_the_jobs_and_pairs_the_workers(redis_url: str, tmp_path: Path) -> None:
    """``--telemetry 'none|admin'``: two workers at once, each taking at most half the streams; each side's CPU
    per event is over the requests its status records name it for, and the run is one pair."""
    out = tmp_path / "e2e.json"
    argv = ["e2e", "--quick", "--streams", "4", "--deltas", "20", "--cancel", "0", "--no-ceiling"]
    argv += ["--no-floor-client", "--telemetry", "none|admin", "--redis-url", redis_url, "--out", str(out)]
    assert run_from_args(_args(*argv)) == 0
    report = json.loads(out.read_text())
    (r,) = report["e2e"]
    assert r["consumer"]["terminals"] == {"completed": 4}
    sides = {s["telemetry"]: s for s in r["sides"]}
    assert set(sides) == {"none", "admin"}
    per_stream = r["expected_contract_events_per_stream"]
    for side in sides.values():
        assert side["requests"] == 2 and side["events"] == 2 * per_stream
        assert side["worker_cpu_us_per_event"] > 0
    assert sum(s["events"] for s in sides.values()) == r["events"]
    assert r["admin_scrapes"].get("200", 0) >= 1 and set(r["admin_scrapes"]) == {"200"}
    assert r["admin_warmup_scrape"] == 200  # the first, cold scrape falls in the warm-up, not the measured run
    (cost,) = report["e2e_telemetry_costs"]
    assert cost["telemetry"] == "admin" and cost["pairs"] == 1
    diff = sides["admin"]["worker_cpu_us_per_event"] - sides["none"]["worker_cpu_us_per_event"]
    assert cost["diffs_us_per_event"] == [diff]


def test_bench_e2e_admin_unscraped_runs_no_scraper(redis_url: str, tmp_path: Path) -> None:
    """``--scrape-every 0``: the endpoint is on (and scraped once in the warm-up), never in the measured run."""
    out = tmp_path / "e2e.json"
    argv = ["e2e", "--quick", "--streams", "2", "--deltas", "20", "--cancel", "0", "--no-ceiling"]
    argv += ["--no-floor-client", "--telemetry", "admin", "--scrape-every", "0", "--redis-url", redis_url]
    assert run_from_args(_args(*argv, "--out", str(out))) == 0
    (r,) = json.loads(out.read_text())["e2e"]
    assert r["consumer"]["terminals"] == {"completed": 2}
    assert r["admin_warmup_scrape"] == 200 and r["admin_scrape_every_s"] == 0
    assert "admin_scrapes" not in r and r["label"].endswith("telemetry=admin scrape=0s")


@pytest.mark.parametrize("every", ["-1", "nan"])
def test_bench_scrape_every_must_be_a_duration(every: str) -> None:
    with pytest.raises(SystemExit, match="--scrape-every"):
        run_from_args(_args("e2e", "--quick", "--telemetry", "admin", "--scrape-every", every))

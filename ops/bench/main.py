"""``sluice bench``: measure sluice against the official SDKs, the byte-level floor and the Redis ceiling,
side by side in one run.

Rule: every target is a ratio of two numbers measured in the same run on the same machine, never an
absolute time; the bench prints a table and (``--out FILE``) writes every raw measurement as JSON, with
the machine it ran on. It asserts nothing about speed: a missed target is shown, not raised.

Modes: ``normalizer`` (part 1, the default), ``e2e`` (part 2: fake provider, worker(s), Redis, consumer,
each a process), ``memory`` (part 3: the same with Redis throttled), ``capacity`` (route limits against a
provider with the same limits: burst, fairness, admission cost; ``sluice.bench.capacity``), ``validators`` (the
JSON Schema validators a tool call's verdict could use; ``sluice.bench.validators``), ``soak`` (a long run at a
steady rate: do RSS, descriptors and Redis memory level off; ``sluice.bench.soak``), ``all``. ``--quick`` shrinks
everything so a mode finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import itertools
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

import sluice
from sluice.bench.normalizer import BenchCheckFailed, DialectResult, run_dialect
from sluice.bench.pairs import LEVEL, telemetry_costs
from sluice.bench.sdk import SDK_NAMES, sdk_versions
from sluice.bench.synth import build_corpus
from sluice.harness.fake.render import DIALECTS
from sluice.worker.config import HTTP_CLIENTS
from sluice.worker.extras import install_hint

__all__ = ["TARGETS", "configure_parser", "main", "run_from_args"]

MODES = ("normalizer", "e2e", "memory", "http", "capacity", "archive", "admin", "validators", "soak", "all")
# "all": not archive, admin, validators, soak

#: the issue's targets, as ratios (shown next to the measured ones, never asserted)
TARGETS: dict[str, float] = {
    "sdk_over_sluice:anthropic": 20.0,
    "sdk_over_sluice:openai-chat": 40.0,
    "sdk_over_sluice:openai-responses": 40.0,
    "sluice_over_floor": 3.0,
    "sluice_over_floor:bedrock-converse": 2.0,  # issue 23: within 2x its floor (frame split + JSON decode)
    "flat_out_over_ceiling": 1.0,
    "latency_p50_ms": 1.0,
    "latency_p99_ms": 5.0,
    "rss_per_stream_kib": 40.0,
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "mode",
        nargs="?",
        choices=MODES,
        default="normalizer",
        help="normalizer (part 1, default) | e2e (part 2) | memory (part 3) | http | archive | admin | validators "
        "(tool-argument validation: the JSON Schema validators compared) | soak (a long run: what grows) | all",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: each mode in well under a minute")
    p.add_argument("--out", metavar="FILE", help="write every measurement as JSON to FILE")
    p.add_argument("--seed", type=int, default=7, help="seed of the generated corpus and streams (default 7)")
    g = p.add_argument_group("normalizer (part 1)")
    g.add_argument("--dialects", default=",".join(DIALECTS), help="comma-separated (default: every dialect)")
    g.add_argument("--size-mb", type=float, default=None, help="corpus per dialect (default 20; --quick: 1)")
    g.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="timed runs per path, best kept (default 3; quick 2; admin 5); validators: interleaved rounds (default 7; "
        "quick 3)",
    )
    g.add_argument("--sdk-repeat", type=int, default=None, help="timed runs of the SDK paths (default: --repeat)")
    g.add_argument("--no-sdk", action="store_true", help="skip the official SDK paths")
    g = p.add_argument_group("capacity (route limits)")
    g.add_argument(
        "--runs",
        default=None,
        help="capacity: comma-separated runs of burst, fairness, unequal, cost (default: all)",
    )
    g.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="capacity: the cost run's interleaved pairs, every other in reverse order (default 12; quick 2)",
    )
    g = p.add_argument_group("archive (sluice archive's throughput)")
    g.add_argument(
        "--requests",
        type=int,
        default=None,
        help="archive: finished requests archived (default 2000; quick 200); admin: attempts (default 200; quick 50)",
    )
    g.add_argument(
        "--entries",
        type=int,
        default=None,
        help="archive: raw (and as many normalized) entries per request (default 200)",
    )
    g.add_argument("--concurrency", type=int, default=8, help="archive: the archiver's requests at once (default 8)")
    g = p.add_argument_group("soak (a long run at a steady rate)")
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="soak: seconds of load (default 3600; quick 30); retention, trim interval and sampling scale with it",
    )
    g.add_argument("--rate", type=float, default=None, help="soak: jobs enqueued per second (default 15; quick 5)")
    g.add_argument(
        "--followers",
        type=int,
        default=None,
        help="soak: relay clients, each following a just-enqueued request over SSE to its end, then the next "
        "(default 30; quick 5)",
    )
    g = p.add_argument_group("end to end (parts 2 and 3)")
    g.add_argument("--streams", default=None, help="concurrent streams, comma-separated runs (default 100)")
    g.add_argument(
        "--pace", default=None, help="provider events/s per stream, comma-separated runs; 0 = flat out (default 0)"
    )
    g.add_argument("--workers", default="1", help="worker processes, comma-separated runs (default 1)")
    g.add_argument(
        "--http-client",
        default="wire",
        help="the worker's upstream HTTP client, comma-separated runs: wire (default), httpx",
    )
    g.add_argument(
        "--telemetry",
        default="none",
        help="the worker's telemetry, comma-separated runs: none (default), otlp (exported to the fake provider), "
        "admin (the admin endpoint on, /metrics scraped every second, or as --scrape-every says; one worker); "
        "none|admin (or none|otlp): two workers side by side on the same jobs, one of each, each taking at most "
        "half the streams, each one's CPU per event over the requests it ran",
    )
    g.add_argument(
        "--scrape-every",
        type=float,
        default=1.0,
        help="e2e with telemetry admin: seconds between the benchmark's GETs of /metrics, as a Prometheus with that "
        "scrape interval (default 1; 0: never scraped in the measured run, the endpoint's cost without scrapes)",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="e2e: run the cases this many times, every other round in reverse order (ABBA); each telemetry "
        "setting's cost is printed as the median of its per-round pairs with none, with the sign test's 95 %% "
        "interval (default 1; sluice.bench.pairs)",
    )
    g.add_argument(
        "--deltas",
        type=int,
        default=None,
        help="text deltas per stream (default 1000; quick 200; admin 20, quick 10)",
    )
    g.add_argument("--tools", type=int, default=0, help="tool calls per stream (default 0)")
    g.add_argument("--dialect", default="anthropic", choices=DIALECTS, help="dialect of the e2e streams")
    g.add_argument("--cancel", type=int, default=None, help="streams cancelled to time cancel-to-close (default 10)")
    g.add_argument("--ceiling-commands", type=int, default=None, help="XADDs in the ceiling (default 100000)")
    g.add_argument("--no-ceiling", action="store_true", help="skip the XADD ceiling")
    g.add_argument("--no-floor-client", action="store_true", help="skip the plain-socket floor client run")
    g.add_argument(
        "--redis-url",
        default=None,
        help="default: $REDIS_URL, else 127.0.0.1:6379, else a private one; soak: a private one",
    )
    g.add_argument("--redis-delay-ms", type=float, default=20.0, help="memory mode: Redis reply delay (default 20)")
    g.add_argument(
        "--redis-bytes-per-s",
        type=int,
        default=1_000_000,
        help="memory mode: bytes/s the worker may send to Redis (default 1e6; 0: no cap)",
    )
    g.add_argument(
        "--cluster",
        action="store_true",
        help="run on a Redis Cluster: --redis-url names a node of one, else a local one is started (3 masters, "
        "3 replicas)",
    )
    g.add_argument("--job-shards", type=int, default=None, help="with --cluster: job shards (default 3)")
    g.add_argument(
        "--cluster-appends",
        default="pipe",
        help="with --cluster: the cluster_appends value recorded with the run, comma-separated runs: pipe (default), "
        "redis-py (recorded only: the worker ignores the key, so both run the routed pipes)",
    )
    g.add_argument(
        "--durability", default="primary", help="the worker's durability, comma-separated runs: primary, replica"
    )
    g.add_argument("--profile", choices=("py-spy", "pyinstrument"), default=None, help="profile the worker")
    g.add_argument("--profile-dir", default=None, help="where profiles are kept (default: a temp dir)")


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str | None] = {"sluice": sluice.__version__}  # the distribution is sluice-llm
    for name in ("msgspec", "redis", "hiredis", "httpx", "anyio", "psutil"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions.update(sdk_versions())
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "packages": versions,
    }
    with contextlib.suppress(ImportError):
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    return info


# -- part 1 ----------------------------------------------------------------------------------------------


def run_normalizer(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    size_mb = args.size_mb if args.size_mb is not None else (1.0 if args.quick else 20.0)
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 3)
    dialects = [d.strip() for d in args.dialects.split(",") if d.strip()]
    unknown = [d for d in dialects if d not in DIALECTS]
    if unknown:
        raise ValueError(f"unknown dialect {unknown[0]!r}; known: {', '.join(DIALECTS)}")
    if not args.no_sdk:
        _hint_missing_sdks(dialects)
    results: list[DialectResult] = []
    for d in dialects:
        t = time.perf_counter()
        corpus = build_corpus(d, int(size_mb * 1_000_000), args.seed)
        console.log(
            f"{d}: {len(corpus.streams)} responses, {corpus.bytes / 1e6:.1f} MB, {corpus.sse_events} events, "
            f"{corpus.chunks} chunks (built in {time.perf_counter() - t:.1f}s)"
        )
        results.append(
            run_dialect(
                corpus, repeat=repeat, sdk_repeat=args.sdk_repeat, with_sdk=not args.no_sdk, progress=console.log
            )
        )
    console.print(normalizer_table(results))
    return {
        "config": {
            "size_mb": size_mb,
            "repeat": repeat,
            "sdk_repeat": args.sdk_repeat or repeat,
            "seed": args.seed,
            "chunk_bytes": [1, 4096],
        },
        "dialects": [r.to_json() for r in results],
    }


def _hint_missing_sdks(dialects: list[str]) -> None:
    """One line per SDK the comparison needs but cannot import: its column stays empty, and says why."""
    installed = sdk_versions()
    needed = dict.fromkeys(SDK_NAMES[d].split()[0] for d in dialects if d in SDK_NAMES)
    for name in needed:
        if installed.get(name) is None:
            print(
                f"sluice bench: the {name} SDK is not installed, so its comparison is skipped (install the bench "
                f"extra: {install_hint('bench')}; or pass --no-sdk)",
                file=sys.stderr,
            )


def run_http(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    from sluice.bench.http_parse import run_http_parse

    events = 2_000 if args.quick else 20_000
    results = run_http_parse(events=events, repeat=args.repeat or (2 if args.quick else 7), progress=console.log)
    table = Table(title=f"HTTP/1.1 response parsing: µs of CPU per SSE event ({events:,} events of ~270 B, chunked)")
    for col in ("path", "one chunk per read (paced)", "64 KiB reads (flat out)"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for path in dict.fromkeys(r.path for r in results):
        row = {r.reads: r.us_per_event for r in results if r.path == path}
        table.add_row(path, f"{row['chunk per read']:.2f}", f"{row['64 KiB reads']:.2f}")
    console.print(table)
    return [r.to_json() for r in results]


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}×"


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" [green]✓[/]" if ok else " [red]✗[/]")


def normalizer_table(results: list[DialectResult]) -> Table:
    t = Table(title="Normalizer throughput (same bytes, same run; best of N; ratios from process CPU time)")
    for col in (
        "dialect",
        "path",
        "MB/s",
        "events/s",
        "MB/CPU-s",
        "events/CPU-s",
        "µs/event",
        "SDK ÷ sluice",
        "sluice ÷ floor",
    ):
        t.add_column(col, justify="left" if col in ("dialect", "path") else "right")
    for r in results:
        for key in ("sluice", "floor", "sdk"):
            timing = r.paths.get(key)
            row = r.row(key)
            if timing is None or row is None:
                continue
            sdk_ratio = sluice_ratio = ""
            if key == "sluice":
                target = TARGETS.get(f"sdk_over_sluice:{r.dialect}")
                ratio = r.ratio("sdk", "sluice")
                ok = None if ratio is None or target is None else ratio >= target
                sdk_ratio = _x(ratio) + (f" (≥{target:g})" if target and ratio else "") + _mark(ok)
                fl = r.ratio("sluice", "floor")
                cap = TARGETS.get(f"sluice_over_floor:{r.dialect}", TARGETS["sluice_over_floor"])
                sluice_ratio = _x(fl) + f" (≤{cap:g})" + _mark(None if fl is None else fl <= cap)
            t.add_row(
                r.dialect if key == "sluice" else "",
                timing.name,
                f"{row['mb_per_s']:.1f}",
                f"{row['events_per_s']:,.0f}",
                f"{row['mb_per_cpu_s']:.1f}",
                f"{row['events_per_cpu_s']:,.0f}",
                f"{row['us_per_event']:.2f}",
                sdk_ratio,
                sluice_ratio,
            )
        t.add_section()
    return t


# -- parts 2 and 3 ---------------------------------------------------------------------------------------


def _e2e_options(args: argparse.Namespace, redis_url: str, *, memory: bool) -> list[Any]:
    from sluice.bench.e2e import E2EOptions

    quick = args.quick
    streams = _ints(args.streams) if args.streams else [100]
    paces = _floats(args.pace) if args.pace else [0.0]
    workers = _ints(args.workers)
    deltas = args.deltas or (200 if quick else 1000)
    cancel = args.cancel if args.cancel is not None else (3 if quick else 10)
    commands = args.ceiling_commands or (20_000 if quick else 100_000)
    clients = [c.strip() for c in args.http_client.split(",") if c.strip()]
    unknown = sorted(set(clients) - set(HTTP_CLIENTS))
    if unknown:
        raise SystemExit(f"sluice bench: unknown --http-client {', '.join(unknown)}")
    telemetry = [t.strip() for t in args.telemetry.split(",") if t.strip()]
    if unknown := sorted({x for t in telemetry for x in t.split("|")} - {"none", "otlp", "admin"}):
        raise SystemExit(f"sluice bench: unknown --telemetry {', '.join(unknown)}")
    if bad := [t for t in telemetry if "|" in t and (t.count("|") != 1 or "none" not in t.split("|"))]:
        raise SystemExit(f"sluice bench: --telemetry {bad[0]}: side by side is 'none|SETTING'")
    cluster = bool(getattr(args, "cluster", False))
    appends = [a.strip() for a in args.cluster_appends.split(",") if a.strip()] if cluster else ["pipe"]
    if unknown := sorted(set(appends) - {"pipe", "redis-py"}):
        raise SystemExit(f"sluice bench: unknown --cluster-appends {', '.join(unknown)}")
    durability = [d.strip() for d in args.durability.split(",") if d.strip()]
    if unknown := sorted(set(durability) - {"primary", "replica"}):
        raise SystemExit(f"sluice bench: unknown --durability {', '.join(unknown)}")
    shards = (args.job_shards or 3) if cluster else (args.job_shards or 1)
    out = []
    first = True
    for n, pace, w, client, tel, app, dur in itertools.product(
        streams, paces, workers, clients, telemetry, appends, durability
    ):
        out.append(
            E2EOptions(
                streams=n,
                pace_eps=pace,
                deltas=deltas,
                tools=args.tools,
                dialect=args.dialect,
                workers=w,
                http_client=client,
                telemetry=tel,
                scrape_every_s=args.scrape_every,
                warmup=min(10, n),
                cancel=0 if memory else cancel,
                ceiling=not args.no_ceiling and first,
                ceiling_commands=commands,
                floor_client=not args.no_floor_client and not memory,
                redis_delay_ms=args.redis_delay_ms if memory else 0.0,
                redis_bytes_per_s=args.redis_bytes_per_s if memory else 0,
                profile=args.profile,
                profile_dir=Path(args.profile_dir) if args.profile_dir else None,
                redis_url=redis_url,
                redis_cluster=cluster,
                job_shards=shards,
                cluster_appends=app,
                durability=dur,
                label=("memory" if memory else "e2e")
                + f" n={n} pace={pace:g} workers={w}"
                + ("" if client == "wire" else f" http={client}")
                + ("" if tel == "none" else f" telemetry={tel}")
                + ("" if "admin" not in tel or args.scrape_every == 1 else f" scrape={args.scrape_every:g}s")
                + (f" cluster shards={shards} appends={app}" if cluster else "")
                + ("" if dur == "primary" else f" durability={dur}"),
            )
        )
        first = False  # one ceiling per mode: it is the same for every case
    if args.rounds < 1:
        raise SystemExit("sluice bench: --rounds must be at least 1")
    if not args.scrape_every >= 0:  # NaN too
        raise SystemExit("sluice bench: --scrape-every must be 0 (never) or a number of seconds")
    rounds = []
    for n in range(args.rounds):
        # ABBA: every other round runs the cases backwards, so a steady drift of the machine cancels in pairs.
        for opts in out if n % 2 == 0 else reversed(out):
            rounds.append(dataclasses.replace(opts, round=n, ceiling=opts.ceiling and n == 0))
    return rounds


def run_e2e_mode(args: argparse.Namespace, console: Console, *, memory: bool) -> list[dict[str, Any]]:
    from sluice.bench.e2e import run_e2e
    from sluice.bench.redis_ceiling import find_or_start_redis

    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    where = find_or_start_cluster(args.redis_url) if args.cluster else find_or_start_redis(args.redis_url)
    with where as (url, origin):
        console.log(f"Redis: {origin}")
        for opts in _e2e_options(args, url, memory=memory):
            console.log(f"{opts.label}")
            try:
                res = asyncio.run(run_e2e(opts, progress=lambda m: console.log(f"  {m}")))
            except Exception as exc:  # one broken case is reported, and the others still run
                console.log(f"[red]{opts.label}: {type(exc).__name__}: {exc}[/]")
                failed.append({"label": opts.label, "error": f"{type(exc).__name__}: {exc}"})
                continue
            res["redis"] = origin
            results.append(res)
    ceiling = next((c for r in results for c in r.get("ceiling", []) if c["method"].startswith("redis-py")), None)
    for r in results:
        if ceiling is not None:
            r["ceiling_redispy_xadd_per_s"] = ceiling["xadd_per_s"]
            r["events_over_ceiling"] = r["events_per_s"] / ceiling["xadd_per_s"] if ceiling["xadd_per_s"] else None
    console.print(e2e_table(results, "Memory under a slow Redis" if memory else "End to end"))
    if costs := telemetry_costs(results):
        console.print(costs_table(costs))
    results += failed
    for r in results:
        if died := r.get("worker_died"):
            console.print(f"[red]{r['label']}: the worker exited with code {died['exit_code']}[/]; its log ends:")
            for line in died["log_tail"]:
                console.print(f"  {line}", markup=False, highlight=False)
        if "ceiling" in r:
            console.print(ceiling_table(r["ceiling"]))
        if prof := r.get("profile"):
            _print_profile(console, r["label"], prof)
    return results


def run_capacity_mode(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from sluice.bench.capacity import RUNS, CapacityOptions, run_capacity
    from sluice.bench.redis_ceiling import find_or_start_redis

    runs = tuple(x.strip() for x in args.runs.split(",") if x.strip()) if args.runs else RUNS
    if not runs or set(runs) - set(RUNS):
        raise SystemExit(f"sluice bench: --runs takes runs of {', '.join(RUNS)}, got {args.runs!r}")
    if args.pairs is not None and args.pairs < 1:
        raise SystemExit("sluice bench: --pairs must be at least 1")
    with find_or_start_redis(args.redis_url) as (url, origin):
        console.log(f"Redis: {origin}")
        opts = CapacityOptions.for_run(url, args.quick, pairs=args.pairs, runs=runs)
        result = asyncio.run(run_capacity(opts, progress=lambda m: console.log(f"  {m}")))
    result["redis"] = origin
    console.print(capacity_table(result))
    return result


def capacity_table(res: dict[str, Any]) -> Table:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    t = Table(title=f"Capacity (cap {res['cap']}, rpm {res['rpm'] or 'off'})")
    for col in ("run", "figure", "target", "pass"):
        t.add_column(col)
    if b := res.get("burst"):
        t.add_row(
            "burst", f"peak in flight {b['peak_in_flight']}", f"<= {res['cap']}", _mark(b["pass"]["peak_within_cap"])
        )
        t.add_row(
            "burst",
            f"429s {b['responses_429']} of {b['provider_requests']} requests",
            "<= 1%",
            _mark(b["pass"]["429_at_most_1pct"]),
        )
        t.add_row("burst", f"terminals {b['states']}", "all completed", _mark(b["pass"]["all_completed"]))
        t.add_row(
            "burst",
            f"{b['throughput_per_s'] or 0:.2f}/s of {b['cap_per_s']:.2f}/s ({pct(b['throughput_over_cap'])})",
            ">= 90%",
            _mark(b["pass"]["throughput_90pct"]),
        )
    if f := res.get("fairness"):
        t.add_row(
            "fairness",
            f"B median wait {f['b_median_wait_ms_with_a']} ms with A, {f['b_median_wait_ms_alone']} ms alone "
            f"(x{f['ratio'] or 0:.2f})",
            "<= x2",
            _mark(f["pass"]["ratio_at_most_2"]),
        )
    if u := res.get("unequal"):
        t.add_row(
            "unequal",
            f"peak leases {u['peak_leases']} (slots: keys), jobs run {u['jobs_run']}",
            "<= slots",
            _mark(u["pass"]["leases_within_slots"]),
        )
        t.add_row(
            "unequal",
            f"makespan {u['makespan_s'] or 0:.2f} s, ideal {u['ideal_s']:.2f} s (x{u['makespan_over_ideal'] or 0:.2f})",
            "<= x1.5",
            _mark(u["pass"]["makespan_within_1_5x"]),
        )
    if c := res.get("cost"):
        cu = c["cpu_us_per_request"]
        for name, label in (("limited", "cost"), ("budgeted", "budget cost")):
            x = c[name]
            interval = x["interval_over_unlimited"]
            within = f", 95% interval {pct(interval[0])} .. {pct(interval[1])}" if interval else ""
            t.add_row(
                label,
                f"{cu['unlimited']:.0f} -> {cu[name]:.0f} µs CPU per request, median of {c['pairs']} pairs "
                f"{pct(x['added_over_unlimited'])}{within}",
                "<= +10%",
                _mark(c["pass"][f"{name}_added_at_most_10pct"]),
            )
    return t


def run_soak_mode(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from sluice.bench.soak import SoakOptions, run_soak

    with _soak_redis(args.redis_url) as (url, origin):
        console.log(f"Redis: {origin}")
        opts = SoakOptions.for_run(url, args.quick, args.duration, args.rate, args.followers, args.seed)
        result = asyncio.run(run_soak(opts, progress=lambda m: console.log(f"  {m}")))
    result["redis_origin"] = origin
    console.print(soak_table(result))
    return result


@contextlib.contextmanager
def _soak_redis(url: str | None) -> Iterator[tuple[str, str]]:
    """``--redis-url`` if given, else a private server: the soak judges Redis's whole ``used_memory``."""
    if url:
        yield url, "given"
        return
    from sluice.harness.embedded_redis import embedded_redis

    with embedded_redis() as server:
        yield server.url, "started (private)"


def soak_table(res: dict[str, Any]) -> Table:
    from sluice.bench.soak import FDS_SLOPE_MAX_PER_MIN, RSS_SLOPE_MAX_KIB_PER_MIN

    def signed(x: float | None, unit: str) -> str:
        return "—" if x is None else f"{x:+,.1f} {unit}"

    def mib(kib: float | None) -> str:
        return "—" if kib is None else f"{kib / 1024:,.1f}"

    ok, q, red, th = res["pass"], res["requests"], res["redis"], res["thresholds"]
    t = Table(
        title=f"Soak: {res['duration_s']:g} s at {res['rate_per_s']:g} jobs/s, {res['followers']} followers; "
        f"slopes over {res['slope_window_s'][0]:g}-{res['slope_window_s'][1]:g} s ({res['slope_samples']} samples)"
    )
    for col in ("what", "figure", "target", "pass"):
        t.add_column(col)
    t.add_row(
        "requests",
        f"{q['enqueued']:,} enqueued, {q['terminal_once']:,} terminal once ({q['missing']} missing, "
        f"{q['more_than_once']} twice or more, {q['unknown']} unknown), {q['dead_letters']} dead letters",
        "each exactly once",
        _mark(ok["terminal_once"]),
    )
    t.add_row("", f"states {q['states']}", "all completed", _mark(ok["all_completed"]))
    f = res["followers_report"]
    t.add_row(
        "followers",
        f"{f['follows']:,} follows, {f['events']:,} events: {f['outcomes']}",
        f"each the whole log ({f['expected_events_per_request']} events) and end",
        _mark(ok["followers_whole_logs"]),
    )
    t.add_row(
        "jobs stream",
        f"XLEN max {red['jobs_xlen_max']:,}, {red['jobs_xlen_after_idle']} after idle",
        f"<= {th['jobs_xlen_bound']:,}, 0 after idle",
        _mark(ok["jobs_stream_bounded"]),
    )
    for name, p in res["processes"].items():
        rss, fds = p["rss_kib"], p["fds"]
        judged = p["judged"]
        rss_ok = (
            judged
            and p["rss_slope_kib_per_min"] is not None
            and p["rss_slope_kib_per_min"] <= th["rss_slope_max_kib_per_min"]
        )
        fds_ok = (
            judged and p["fds_slope_per_min"] is not None and abs(p["fds_slope_per_min"]) <= th["fds_slope_max_per_min"]
        )
        t.add_row(
            name + ("" if judged else " (not judged)"),
            f"RSS {mib(rss['first'])} → max {mib(rss['max'])} → {mib(rss['after_idle'])} MiB after idle; last half "
            + signed(p["rss_slope_kib_per_min"], "KiB/min"),
            f"<= {RSS_SLOPE_MAX_KIB_PER_MIN:g} KiB/min" if judged else "",
            _mark(rss_ok if judged else None),
        )
        t.add_row(
            "",
            f"fds {fds['first']} → max {fds['max']} → {fds['after_idle']}; last half "
            + signed(p["fds_slope_per_min"], "/min"),
            f"within ±{FDS_SLOPE_MAX_PER_MIN:g}/min" if judged else "",
            _mark(fds_ok if judged else None),
        )
    t.add_row(
        "Redis",
        f"used_memory max {mib(red['used_memory_max_kib'])} MiB; last half "
        f"{signed(red['used_memory_slope_kib_per_min'], 'KiB/min')}, less the terminal stream "
        f"{signed(red['used_memory_less_terminal_slope_kib_per_min'], 'KiB/min')}"
        + ("" if ok["redis_memory_level"] is not None else " (not judged: the server held other keys)"),
        f"within ±{th['redis_slope_max_kib_per_min']:g} KiB/min",
        _mark(ok["redis_memory_level"]),
    )
    t.add_row(
        "",
        f"run's keys max {red['run_keys_max']:,}; last half {signed(red['run_keys_slope_per_min'], '/min')}",
        f"within ±{th['run_keys_slope_max_per_min']:g}/min",
        _mark(ok["run_keys_level"]),
    )
    t.add_row(
        "",
        f"terminal stream {red['terminal_xlen_after_idle']:,} entries, {red['terminal_bytes_per_entry'] or 0:.0f} B "
        f"each (capped at MAXLEN ~ 1,000,000)",
        "",
        "",
    )
    if res["died"]:
        t.add_row("processes", f"[red]died: {res['died']}[/]", "none", _mark(False))
    return t


@contextlib.contextmanager
def find_or_start_cluster(url: str | None) -> Iterator[tuple[str, str]]:
    """Yields (a node's URL, origin): ``url`` if given (a node of a cluster), else a local cluster of 3
    masters and 3 replicas started for the run and stopped after it."""
    if url:
        yield url, "given cluster"
        return
    import tempfile

    from sluice.harness.embedded_cluster import start_cluster

    with start_cluster(tempfile.mkdtemp(prefix="sluice-bench-cluster-")) as cluster:
        yield cluster.seed_url, f"started cluster: 3 masters, 3 replicas ({cluster.binary})"


def _ms(us: float | None) -> str:
    if us is None:
        return "—"
    ms = us / 1000
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _per_request(r: dict[str, Any]) -> str:
    worker, redis = r.get("worker_cpu_us_per_request"), r.get("redis_cpu_us_per_request")
    return "—" if worker is None or redis is None else f"{worker:,.0f}, {redis:,.0f}"


def e2e_table(results: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=f"{title} (fake provider, worker, Redis and consumer are separate processes)")
    cols = (
        "case",
        "events/s",
        "÷ ceiling",
        "worker µs/ev",
        "floor µs/ev",
        "CPU worker / Redis",
        "Redis µs, B /ev",
        "µs/req worker, Redis",
        "latency ms p50/p99/max",
        "floor latency ms p50/p99",
        "1st Δ p99 ms",
        "RSS MiB",
        "KiB/stream",
        "cancel→close ms",
        "completed",
    )
    for c in cols:
        t.add_column(c, justify="left" if c == "case" else "right", no_wrap=True)
    for r in results:
        con = r.get("consumer", {})
        lat, first = con.get("latency_us", {}), con.get("first_delta_latency_us", {})
        cancel = r.get("cancel", {}).get("cancel_to_upstream_close_ms", {})
        ratio = r.get("events_over_ceiling")
        ratio_s = "—" if ratio is None else f"{ratio:.2f}×"
        if ratio is not None and not r["pace_eps_per_stream"]:  # the target applies to flat-out runs
            ratio_s += _mark(ratio >= TARGETS["flat_out_over_ceiling"])
        kib, us = r.get("rss_per_inflight_stream_kib"), r.get("worker_cpu_us_per_event")
        floor = r.get("floor_client", {}).get("cpu_us_per_event")
        over = r.get("worker_over_floor_cpu")  # None when the worker's CPU was too small to read (tiny runs)
        floor_s = "—" if not floor else f"{floor:.1f}" + ("" if over is None else f" ({over:.0f}×)")
        floor_lat = r.get("floor_client", {}).get("latency_us", {})
        floor_lat_s = "—" if not floor_lat else f"{_ms(floor_lat.get('p50'))} / {_ms(floor_lat.get('p99'))}"
        pace = r["pace_eps_per_stream"]
        case = f"{r['streams']} × {'flat out' if not pace else f'{pace:g}/s'}, {r['workers']}w"
        if r.get("redis_cluster"):
            case += f", cluster {r['job_shards']} shards, {r['cluster_appends']}"
        if r.get("durability", "primary") != "primary":
            case += f", {r['durability']}"
        if r.get("http_client", "wire") != "wire":
            case += f", {r['http_client']}"
        if r.get("telemetry", "none") != "none":
            case += f", {r['telemetry']}"
        t.add_row(
            case,
            f"{r['events_per_s']:,.0f}",
            ratio_s,
            "—" if us is None else f"{us:.1f}",
            floor_s,
            f"{100 * r['worker_cpu_util']:.0f}% / " + (f"{100 * rc:.0f}%" if (rc := r.get("redis_cpu_util")) else "—"),
            f"{r.get('redis_cpu_us_per_event') or 0:.1f}, {r.get('redis_bytes_per_event') or 0:.0f}",
            _per_request(r),
            f"{_ms(lat.get('p50'))} / {_ms(lat.get('p99'))} / {_ms(lat.get('max'))}",
            floor_lat_s,
            _ms(first.get("p99")),
            f"{r['rss_baseline_bytes'] / 2**20:.0f} / {r.get('rss_peak_bytes', 0) / 2**20:.0f}",
            "—" if kib is None else f"{kib:.1f}",
            "—" if not cancel else f"{cancel['p50']:.1f} / {cancel['max']:.1f}",
            _terminals(con.get("terminals", {}), r["streams"], "worker_died" in r),
        )
    return t


def costs_table(costs: list[dict[str, Any]]) -> Table:
    t = Table(title="What the telemetry costs: worker CPU µs per event, runs paired by round")
    for col in ("case", "telemetry", "pairs", "none (median)", "cost (median of pairs)", f"{LEVEL:.0%} interval"):
        t.add_column(col, justify="left" if col == "case" else "right", no_wrap=True)
    for c in costs:
        rel, interval, rel_i = c["median_diff_relative"], c["interval_us_per_event"], c["interval_relative"]
        t.add_row(
            c["case"],
            c["telemetry"],
            str(c["pairs"]),
            f"{c['none_median_us_per_event']:.2f}",
            f"{c['median_diff_us_per_event']:+.2f}" + ("" if rel is None else f" ({rel:+.1%})"),
            "— (fewer than 6 pairs)"
            if interval is None
            else f"{interval[0]:+.2f} … {interval[1]:+.2f}"
            + ("" if rel_i is None else f" ({rel_i[0]:+.1%} … {rel_i[1]:+.1%})"),
        )
    return t


def _terminals(terminals: dict[str, int], streams: int, died: bool = False) -> str:
    other = ", ".join(f"{k} {v}" for k, v in terminals.items() if k != "completed")
    other += ("; " if other else "") + ("[red]worker died[/]" if died else "")
    return f"{terminals.get('completed', 0)}/{streams}" + (f" ({other})" if other else "")


def ceiling_table(ceilings: list[dict[str, Any]]) -> Table:
    t = Table(title="Redis ceiling: pipelined XADD of pre-encoded events, one process, same run")
    for col in ("method", "streams", "XADDs", "payload B", "XADD/s", "client CPU µs/XADD"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for c in ceilings:
        t.add_row(
            c["method"],
            str(c["streams"]),
            f"{c['commands']:,}",
            str(c["payload_bytes"]),
            f"{c['xadd_per_s']:,.0f}",
            f"{c['client_cpu_us_per_xadd']:.1f}",
        )
    return t


def _print_profile(console: Console, label: str, prof: dict[str, Any]) -> None:
    if prof.get("error"):
        console.print(f"Worker profile ({label}): {prof['tool']} failed: {prof['error']}", markup=False)
    elif prof.get("tool") == "py-spy":
        t = Table(title=f"Worker profile ({label}): py-spy, {prof.get('samples', 0)} samples, {prof['file']}")
        t.add_column("self time by package")
        t.add_column("%", justify="right")
        t.add_column("top functions (self)")
        t.add_column("%", justify="right")
        pkgs, fns = prof.get("self_by_package_pct", []), prof.get("top_self_pct", [])
        for i in range(max(len(pkgs), len(fns))):
            p = pkgs[i] if i < len(pkgs) else ("", "")
            f = fns[i] if i < len(fns) else ("", "")
            t.add_row(str(p[0]), str(p[1]), str(f[0]), str(f[1]))
        console.print(t)
    else:
        console.print(f"Worker profile ({label}): pyinstrument, {prof.get('file')}")


# -- entry points ------------------------------------------------------------------------------------------


def run_from_args(args: argparse.Namespace) -> int:
    # Wide tables: a terminal gets its own width, a pipe or a file 200 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    report: dict[str, Any] = {
        "bench": "sluice",
        "mode": args.mode,
        "quick": args.quick,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
    }
    started = time.perf_counter()
    try:
        if args.mode in ("normalizer", "all"):
            report["normalizer"] = run_normalizer(args, console)
        if args.mode in ("e2e", "all"):
            report["e2e"] = run_e2e_mode(args, console, memory=False)
            if costs := telemetry_costs(report["e2e"]):
                report["e2e_telemetry_costs"] = costs
        if args.mode in ("memory", "all"):
            report["memory"] = run_e2e_mode(args, console, memory=True)
        if args.mode in ("http", "all"):
            report["http"] = run_http(args, console)
        if args.mode in ("capacity", "all"):
            report["capacity"] = run_capacity_mode(args, console)
        if args.mode == "archive":
            from sluice.bench.archive import run_archive

            report["archive"] = run_archive(args, console)
        if args.mode == "admin":
            from sluice.bench.admin import run_admin

            report["admin"] = run_admin(args, console)
        if args.mode == "soak":
            report["soak"] = run_soak_mode(args, console)
        if args.mode == "validators":
            from sluice.bench.validators import run_validators

            report["validators"] = run_validators(args, console)
    except (BenchCheckFailed, ValueError, RuntimeError) as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 1
    report["elapsed_s"] = time.perf_counter() - started
    if args.out:
        Path(args.out).write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        console.log(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sluice.bench.main``: the same as ``sluice bench``."""
    parser = argparse.ArgumentParser(prog="sluice bench", description=__doc__.split("\n\n")[0])
    configure_parser(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

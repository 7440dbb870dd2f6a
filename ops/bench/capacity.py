"""``sluice bench capacity``: route limits against a provider that enforces the same limits
(docs/design-capacity.md B.11). Three runs, each on its own key prefix, the fake provider and the workers
each a process:

- **burst**: 1,000 jobs at once through 3 workers, the fake capped at 20 concurrent and 600 requests/minute,
  the route's limits the same. Pass: the fake's peak concurrency ≤ the cap, its 429s ≤ 1% of the requests it
  received, every job completed, throughput (jobs / first ``started_at`` to last ``finished_at``) ≥ 90% of
  ``min(cap / stream seconds, rpm / 60)``, the stream seconds being the measured median ``finished_at −
  started_at`` (the scenario's nominal time is reported beside it: ``throughput_over_nominal_cap``).
- **fairness**: tenant A enqueues 900 batch jobs, then tenant B 100 interactive ones (concurrency cap only);
  B's median queue wait (``started_at − queued_at``) against the same 100 B jobs alone on a fresh prefix.
  Pass: ratio ≤ 2.
- **unequal**: two workers of 2 and 16 run slots on one prefix, a route capped at 50 (never binding), 40
  jobs of about 1 s. Pass: every job completed, no worker ever held more leases than its slots (sampled
  every 20 ms), and the makespan (first ``started_at`` to last ``finished_at``) within 1.5× of the ideal
  ``ceil(jobs / 18)`` waves of the measured median stream.
- **cost**: 1,000 one-delta requests through one worker, a route without limits against one whose limits
  never bind, and against jobs under a budget that never binds (a RESERVE and a SETTLE per request, no
  route limits); the worker's CPU per request (the e2e mode's measure). ``--pairs`` rounds (default 12),
  every other round in reverse order (ABBA: a steady drift of the shared machine cancels); each round pairs
  a setting's run with the same round's unlimited one. Pass: the median of the pairs' differences ≤ 10% of
  the unlimited runs' median (its sign-test interval is reported beside it, ``sluice.bench.pairs``).

Rule: like every mode, a missed target is shown and recorded (``pass``), never raised. ``--runs`` picks some
of the runs. ``--quick``: 200 burst jobs against the concurrency cap alone (no RPM: a minute's window does not
fit a quick run), 90 + 10 fairness jobs, 20 unequal jobs of 0.3 s, 200 cost requests in 2 pairs, short
streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sluice.bench.e2e import (
    _KEY_ENV,
    _cleanup,
    _cpu,
    _enqueue_all,
    _start_worker,
    _stop,
    fake_provider_process,
    mean_event_size,
)
from sluice.bench.pairs import median_interval
from sluice.client import SluiceClient
from sluice.schemas.keys import Keys, decode_lease
from sluice.schemas.states import TERMINAL_STATES
from sluice.worker.redis.connect import AnyRedis, connect

__all__ = ["CapacityOptions", "run_capacity"]

ROUTE = "capacity"
RUNS = ("burst", "fairness", "unequal", "cost")


@dataclass(frozen=True, slots=True)
class CapacityOptions:
    redis_url: str
    quick: bool = False
    cap: int = 20
    rpm: int = 600
    workers: int = 3
    max_in_flight: int = 64
    burst_jobs: int = 1000
    burst_deltas: int = 20
    burst_pace_ms: int = 80  # 26 provider events, 25 gaps: 2.0 s a stream, so 20 / 2 s = 600 / min
    fair_a: int = 900
    fair_b: int = 100
    unequal_sizes: tuple[int, int] = (2, 16)
    unequal_cap: int = 50
    unequal_jobs: int = 40
    unequal_deltas: int = 20
    unequal_pace_ms: int = 50  # 21 gaps: about 1 s a stream
    cost_requests: int = 1000
    cost_pairs: int = 12
    runs: tuple[str, ...] = RUNS
    timeout_s: float = 900.0

    @staticmethod
    def for_run(
        redis_url: str, quick: bool, *, pairs: int | None = None, runs: tuple[str, ...] = RUNS
    ) -> CapacityOptions:
        if not quick:
            return CapacityOptions(redis_url, cost_pairs=pairs or 12, runs=runs)
        return CapacityOptions(
            redis_url,
            quick=True,
            runs=runs,
            unequal_jobs=20,
            unequal_deltas=6,
            rpm=0,
            burst_jobs=200,
            burst_deltas=5,
            burst_pace_ms=20,
            fair_a=90,
            fair_b=10,
            cost_requests=200,
            cost_pairs=pairs or 2,
            timeout_s=180.0,
        )


# The budgeted cost case: prices for the route and a budget every tenant falls under, far from binding.
_BUDGETED = (
    f'[prices."{ROUTE}"]\ninput = 1\noutput = 1\ncurrency = "USD"\n'
    '[budgets."*"]\namount = "1000000"\ncurrency = "USD"\n'
)


def _scenario(deltas: int, pace_ms: int) -> str:
    return f"synthetic;deltas={deltas};pace_ms={pace_ms}" if pace_ms else f"synthetic;deltas={deltas}"


def _write_config(
    path: Path,
    redis_url: str,
    prefix: str,
    base_url: str,
    max_in_flight: int,
    limits: dict[str, int],
    extra: str = "",
) -> None:
    lines = [
        f'redis_url = "{redis_url}"',
        f'key_prefix = "{prefix}"',
        f"max_in_flight = {max_in_flight}",
        "shutdown_grace = 10.0",
        "claim_idle_ms = 60000",
        "[timeouts]",
        "connect = 10.0",
        "first_byte = 60.0",
        "idle = 120.0",
        "total = 3600.0",
        f'[routes."{ROUTE}"]',
        'dialect = "anthropic"',
        f'base_url = "{base_url}"',
        'model = "synthetic"',
        f'api_key_env = "{_KEY_ENV}"',
        "send_request_id = true",
        *(f"{k} = {v}" for k, v in limits.items()),
    ]
    path.write_text("\n".join(lines) + "\n" + extra)


def _job(scenario: str, rid: str, tenant: str | None = None, priority: str | None = None) -> dict[str, Any]:
    job: dict[str, Any] = {
        "route": ROUTE,
        "model": scenario,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "benchmark"}]},
    }
    if tenant is not None:
        job["tenant"] = tenant
    if priority is not None:
        job["priority"] = priority
    return job


@dataclass(slots=True)
class _Run:
    """One prefix: its workers' config, the fake's URL, a client."""

    prefix: str
    keys: Keys
    config: Path
    client: SluiceClient


async def _wait_terminal(r: AnyRedis, keys: Keys, rids: list[str], timeout_s: float) -> dict[str, dict[str, str]]:
    """Every request's status once all are terminal (or the timeout passed: the rest as they are)."""
    fields = ("state", "queued_at", "started_at", "finished_at", "worker")
    deadline = time.monotonic() + timeout_s
    left = list(rids)
    out: dict[str, dict[str, str]] = {}
    while True:
        pipe = r.pipeline(transaction=False)
        for rid in left:
            pipe.hmget(keys.request(rid).status, fields)
        rows = await pipe.execute()
        still = []
        for rid, row in zip(left, rows, strict=True):
            doc = {k: (v.decode() if isinstance(v, bytes) else (v or "")) for k, v in zip(fields, row, strict=True)}
            out[rid] = doc
            if doc["state"] not in TERMINAL_STATES:
                still.append(rid)
        left = still
        if not left or time.monotonic() > deadline:
            return out
        await asyncio.sleep(0.25)


async def _fake_stats(base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as http:
        resp = await http.get(f"{base_url}/_fake/stats", params={"requests": "0"})
        resp.raise_for_status()
        doc: dict[str, Any] = resp.json()
        counters: dict[str, Any] = doc["counters"]
        return counters


@contextlib.asynccontextmanager
async def _workers(n: int, config: Path, api_key: str, tmp: Path, label: str) -> Any:
    started = []
    try:
        for i in range(n):
            started.append(await _start_worker(config, tmp / f"{label}-worker-{i}.log", api_key, None, None))
        yield started
    finally:
        for w in started:
            await _stop(w.proc)


def _median(xs: list[int]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _timings(statuses: dict[str, dict[str, str]]) -> tuple[float | None, float]:
    """Seconds from the first ``started_at`` to the last ``finished_at`` (None without both), and the median
    stream's seconds (``finished_at − started_at``; 0 without any)."""
    started = [int(s["started_at"]) for s in statuses.values() if s["started_at"]]
    finished = [int(s["finished_at"]) for s in statuses.values() if s["finished_at"]]
    durations = [
        int(s["finished_at"]) - int(s["started_at"]) for s in statuses.values() if s["started_at"] and s["finished_at"]
    ]
    span_s = (max(finished) - min(started)) / 1000 if started and finished else None
    return span_s, (_median(durations) or 0) / 1000


def _states(statuses: dict[str, dict[str, str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for doc in statuses.values():
        counts[doc["state"] or "missing"] = counts.get(doc["state"] or "missing", 0) + 1
    return counts


@contextlib.contextmanager
def _tempdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sluice-bench-capacity-") as d:
        yield Path(d)


async def run_capacity(opts: CapacityOptions, progress: Any = lambda _: None) -> dict[str, Any]:
    """The three runs; returns their measurements and pass flags (see the module docstring)."""
    api_key = f"bench-{uuid.uuid4().hex}"
    r = connect(opts.redis_url, cluster=False)
    prefixes: list[str] = []
    try:
        with _tempdir() as tmp:

            def new_run(label: str, base_url: str, limits: dict[str, int], extra: str = "") -> _Run:
                prefix = f"sluice-bench:{uuid.uuid4().hex[:8]}:{label}"
                prefixes.append(prefix)
                path = tmp / f"{label}.toml"
                _write_config(path, opts.redis_url, prefix, base_url, opts.max_in_flight, limits, extra)
                return _Run(prefix, Keys(prefix), path, SluiceClient(opts.redis_url, key_prefix=prefix))

            report: dict[str, Any] = {"quick": opts.quick, "cap": opts.cap, "rpm": opts.rpm or None}
            runs = {"burst": _burst, "fairness": _fairness, "unequal": _unequal, "cost": _cost}
            for name in opts.runs:
                report[name] = await runs[name](opts, r, api_key, tmp, new_run, progress)
            report["pass"] = all(report[k]["pass"]["all"] for k in opts.runs)
            return report
    finally:
        for prefix in prefixes:
            with contextlib.suppress(Exception):
                await _cleanup(r, prefix)
        await r.aclose()


async def _burst(
    opts: CapacityOptions, r: AnyRedis, api_key: str, tmp: Path, new_run: Any, progress: Any
) -> dict[str, Any]:
    fake_args = ["--max-concurrency", str(opts.cap)]
    limits = {"max_concurrency": opts.cap}
    if opts.rpm:
        fake_args += ["--requests-per-minute", str(opts.rpm)]
        limits["requests_per_minute"] = opts.rpm
    scenario = _scenario(opts.burst_deltas, opts.burst_pace_ms)
    _, _, provider_events = mean_event_size("anthropic", scenario)
    stream_s = (provider_events - 1) * opts.burst_pace_ms / 1000  # the fake sleeps between events
    progress(f"burst: {opts.burst_jobs} jobs, {opts.workers} workers, fake and route at {limits}, {scenario}")
    async with fake_provider_process(api_key, fake_args) as (base_url, _):
        run: _Run = new_run("burst", base_url, limits)
        async with _workers(opts.workers, run.config, api_key, tmp, "burst"):
            rids = [f"burst-{i:05d}" for i in range(opts.burst_jobs)]
            await _enqueue_all(run.client, [_job(scenario, rid) for rid in rids])
            statuses = await _wait_terminal(r, run.keys, rids, opts.timeout_s)
            stats = await _fake_stats(base_url)
        await run.client.aclose()
    span_s, median_s = _timings(statuses)
    throughput = opts.burst_jobs / span_s if span_s else None
    measured_s = median_s or stream_s

    def bound_for(seconds: float) -> float:
        return min(opts.cap / seconds, opts.rpm / 60) if opts.rpm else opts.cap / seconds

    bound, nominal_bound = bound_for(measured_s), bound_for(stream_s)
    requests = int(stats.get("provider_requests", 0))
    r429 = int(stats.get("responses_429", 0))
    states = _states(statuses)
    out: dict[str, Any] = {
        "jobs": opts.burst_jobs,
        "workers": opts.workers,
        "scenario": scenario,
        "nominal_stream_s": stream_s,
        "median_stream_s": measured_s,
        "states": states,
        "peak_in_flight": int(stats.get("peak_in_flight", 0)),
        "provider_requests": requests,
        "responses_429": r429,
        "pct_429": 100 * r429 / requests if requests else None,
        "span_s": span_s,
        "throughput_per_s": throughput,
        "cap_per_s": bound,
        "throughput_over_cap": throughput / bound if throughput else None,
        "nominal_cap_per_s": nominal_bound,
        "throughput_over_nominal_cap": throughput / nominal_bound if throughput else None,
    }
    checks = {
        "peak_within_cap": out["peak_in_flight"] <= opts.cap,
        "429_at_most_1pct": out["pct_429"] is not None and out["pct_429"] <= 1.0,
        "all_completed": states == {"completed": opts.burst_jobs},
        "throughput_90pct": out["throughput_over_cap"] is not None and out["throughput_over_cap"] >= 0.9,
    }
    out["pass"] = {**checks, "all": all(checks.values())}
    progress(f"  {out}")
    return out


async def _fairness(
    opts: CapacityOptions, r: AnyRedis, api_key: str, tmp: Path, new_run: Any, progress: Any
) -> dict[str, Any]:
    scenario = _scenario(opts.burst_deltas, opts.burst_pace_ms)
    limits = {"max_concurrency": opts.cap}
    progress(f"fairness: A {opts.fair_a} batch then B {opts.fair_b} interactive, then B alone; {limits}, {scenario}")

    def waits(statuses: dict[str, dict[str, str]], rids: list[str]) -> list[int]:
        return [
            int(statuses[x]["started_at"]) - int(statuses[x]["queued_at"])
            for x in rids
            if statuses[x]["started_at"] and statuses[x]["queued_at"]
        ]

    async with fake_provider_process(api_key, ["--max-concurrency", str(opts.cap)]) as (base_url, _):
        mixed: _Run = new_run("fair-mixed", base_url, limits)
        async with _workers(opts.workers, mixed.config, api_key, tmp, "fair-mixed"):
            a = [f"a-{i:05d}" for i in range(opts.fair_a)]
            b = [f"b-{i:05d}" for i in range(opts.fair_b)]
            await _enqueue_all(mixed.client, [_job(scenario, x, "A", "batch") for x in a])
            await _enqueue_all(mixed.client, [_job(scenario, x, "B", "interactive") for x in b])
            mixed_st = await _wait_terminal(r, mixed.keys, a + b, opts.timeout_s)
        await mixed.client.aclose()
        alone: _Run = new_run("fair-alone", base_url, limits)
        async with _workers(opts.workers, alone.config, api_key, tmp, "fair-alone"):
            await _enqueue_all(alone.client, [_job(scenario, x, "B", "interactive") for x in b])
            alone_st = await _wait_terminal(r, alone.keys, b, opts.timeout_s)
        await alone.client.aclose()
        stats = await _fake_stats(base_url)
    with_a, without_a = _median(waits(mixed_st, b)), _median(waits(alone_st, b))
    # A floor of one scheduling tick: B alone can wait ~0 ms, and a ratio over ~0 says nothing.
    ratio = with_a / max(without_a, 1.0) if with_a is not None and without_a is not None else None
    out: dict[str, Any] = {
        "a_batch": opts.fair_a,
        "b_interactive": opts.fair_b,
        "b_median_wait_ms_with_a": with_a,
        "b_median_wait_ms_alone": without_a,
        "a_median_wait_ms": _median(waits(mixed_st, a)),
        "ratio": ratio,
        "states": _states({**mixed_st, **{f"alone:{k}": v for k, v in alone_st.items()}}),
        "peak_in_flight": int(stats.get("peak_in_flight", 0)),
        "responses_429": int(stats.get("responses_429", 0)),
    }
    checks = {
        "ratio_at_most_2": ratio is not None and ratio <= 2.0,
        "all_completed": out["states"] == {"completed": opts.fair_a + 2 * opts.fair_b},
    }
    out["pass"] = {**checks, "all": all(checks.values())}
    progress(f"  {out}")
    return out


async def _unequal(
    opts: CapacityOptions, r: AnyRedis, api_key: str, tmp: Path, new_run: Any, progress: Any
) -> dict[str, Any]:
    scenario = _scenario(opts.unequal_deltas, opts.unequal_pace_ms)
    sizes = opts.unequal_sizes
    slots = sum(sizes)
    progress(f"unequal: workers of {sizes} slots, cap {opts.unequal_cap}, {opts.unequal_jobs} jobs, {scenario}")
    async with fake_provider_process(api_key, ["--max-concurrency", str(opts.unequal_cap)]) as (base_url, _):
        run: _Run = new_run("unequal", base_url, {"max_concurrency": opts.unequal_cap})
        configs = []
        for size in sizes:  # one prefix, each worker its own max_in_flight
            path = run.config.with_name(f"unequal-{size}.toml")
            path.write_text(
                run.config.read_text().replace(f"max_in_flight = {opts.max_in_flight}", f"max_in_flight = {size}")
            )
            configs.append(path)
        async with contextlib.AsyncExitStack() as stack:
            workers = [
                (await stack.enter_async_context(_workers(1, c, api_key, tmp, f"unequal-{i}")))[0]
                for i, c in enumerate(configs)
            ]
            size_of = {f"{socket.gethostname()}-{w.proc.pid}": size for w, size in zip(workers, sizes, strict=True)}
            peaks = {name: 0 for name in size_of}
            done = asyncio.Event()

            async def sample() -> None:
                lease = run.keys.route(ROUTE).lease
                while not done.is_set():
                    held = [decode_lease(v).worker for v in (await r.hgetall(lease)).values()]
                    for name in peaks:
                        peaks[name] = max(peaks[name], held.count(name))
                    await asyncio.sleep(0.02)

            sampler = asyncio.create_task(sample())
            rids = [f"unequal-{i:05d}" for i in range(opts.unequal_jobs)]
            try:
                await _enqueue_all(run.client, [_job(scenario, rid) for rid in rids])
                statuses = await _wait_terminal(r, run.keys, rids, opts.timeout_s)
            finally:
                done.set()
                await sampler
        await run.client.aclose()
    span_s, stream_s = _timings(statuses)
    ideal_s = math.ceil(opts.unequal_jobs / slots) * stream_s
    ran = {size: sum(1 for s in statuses.values() if size_of.get(s.get("worker") or "") == size) for size in sizes}
    states = _states(statuses)
    out: dict[str, Any] = {
        "sizes": list(sizes),
        "cap": opts.unequal_cap,
        "jobs": opts.unequal_jobs,
        "scenario": scenario,
        "states": states,
        "median_stream_s": stream_s,
        "ideal_s": ideal_s,
        "makespan_s": span_s,
        "makespan_over_ideal": span_s / ideal_s if span_s and ideal_s else None,
        "peak_leases": {str(size_of[n]): v for n, v in peaks.items()},
        "jobs_run": {str(k): v for k, v in ran.items()},
    }
    checks = {
        "all_completed": states == {"completed": opts.unequal_jobs},
        "leases_within_slots": all(v <= size_of[n] for n, v in peaks.items()),
        "makespan_within_1_5x": out["makespan_over_ideal"] is not None and out["makespan_over_ideal"] <= 1.5,
    }
    out["pass"] = {**checks, "all": all(checks.values())}
    progress(f"  {out}")
    return out


async def _cost(
    opts: CapacityOptions, r: AnyRedis, api_key: str, tmp: Path, new_run: Any, progress: Any
) -> dict[str, Any]:
    scenario = _scenario(1, 0)
    cases: dict[str, dict[str, int]] = {
        "unlimited": {},
        "limited": {"max_concurrency": 100_000, "requests_per_minute": 10_000_000},
        # No route limits; every job under a budget (a RESERVE and a SETTLE per request) that never binds.
        "budgeted": {"max_tokens": 64},
    }
    extras = {"budgeted": _BUDGETED}
    progress(f"cost: {opts.cost_requests} one-delta requests through one worker, {cases}, {opts.cost_pairs} pairs")
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    states: dict[str, int] = {}
    async with fake_provider_process(api_key) as (base_url, _):
        for rnd in range(opts.cost_pairs):
            # ABBA: every other round backwards, so a steady drift of the shared machine cancels in the pairs.
            for name in list(cases) if rnd % 2 == 0 else list(reversed(cases)):
                run: _Run = new_run(f"cost-{name}-{rnd}", base_url, cases[name], extras.get(name, ""))
                async with _workers(1, run.config, api_key, tmp, f"cost-{name}-{rnd}") as (w,):
                    rids = [f"c-{i:05d}" for i in range(opts.cost_requests)]
                    before = _cpu(w.ps)
                    await _enqueue_all(run.client, [_job(scenario, x) for x in rids])
                    statuses = await _wait_terminal(r, run.keys, rids, opts.timeout_s)
                    cpu[name].append((_cpu(w.ps) - before) / opts.cost_requests * 1e6)
                await run.client.aclose()
                for k, v in _states(statuses).items():
                    states[k] = states.get(k, 0) + v
    base = statistics.median(cpu["unlimited"])
    out: dict[str, Any] = {
        "requests": opts.cost_requests,
        "pairs": opts.cost_pairs,
        "cpu_us_per_request": {k: statistics.median(v) for k, v in cpu.items()},
        "cpu_us_per_request_all": cpu,
        "states": states,
    }
    checks: dict[str, bool] = {}
    for name in ("limited", "budgeted"):
        diffs = [x - u for x, u in zip(cpu[name], cpu["unlimited"], strict=True)]
        added = statistics.median(diffs)
        interval = median_interval(diffs)
        out[name] = {
            "added_us_per_request": added,
            "added_over_unlimited": added / base if base else None,
            "interval_over_unlimited": [x / base for x in interval] if interval and base else None,
        }
        over = out[name]["added_over_unlimited"]
        checks[f"{name}_added_at_most_10pct"] = over is not None and over <= 0.10
    checks["all_completed"] = states == {"completed": len(cases) * opts.cost_pairs * opts.cost_requests}
    out["pass"] = {**checks, "all": all(checks.values())}
    progress(f"  {out}")
    return out

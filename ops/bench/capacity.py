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
- **cost**: 1,000 one-delta requests through one worker, a route without limits against one whose limits
  never bind, and against jobs under a budget that never binds (a RESERVE and a SETTLE per request, no
  route limits); the worker's CPU per request (the e2e mode's measure). Pass: each difference ≤ 10% of the
  unlimited cost. Runs alternate and the best of each is kept (the machine is shared).

Rule: like every mode, a missed target is shown and recorded (``pass``), never raised. ``--quick``: 200 burst
jobs against the concurrency cap alone (no RPM: a minute's window does not fit a quick run), 90 + 10 fairness
jobs, 200 cost requests, short streams.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from sluice.client import SluiceClient
from sluice.schemas.keys import Keys
from sluice.schemas.states import TERMINAL_STATES
from sluice.worker.redis.connect import AnyRedis, connect

__all__ = ["CapacityOptions", "run_capacity"]

ROUTE = "capacity"


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
    cost_requests: int = 1000
    cost_repeat: int = 3
    timeout_s: float = 900.0

    @staticmethod
    def for_run(redis_url: str, quick: bool) -> CapacityOptions:
        if not quick:
            return CapacityOptions(redis_url)
        return CapacityOptions(
            redis_url,
            quick=True,
            rpm=0,
            burst_jobs=200,
            burst_deltas=5,
            burst_pace_ms=20,
            fair_a=90,
            fair_b=10,
            cost_requests=200,
            cost_repeat=1,
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
    fields = ("state", "queued_at", "started_at", "finished_at")
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
            report["burst"] = await _burst(opts, r, api_key, tmp, new_run, progress)
            report["fairness"] = await _fairness(opts, r, api_key, tmp, new_run, progress)
            report["cost"] = await _cost(opts, r, api_key, tmp, new_run, progress)
            report["pass"] = all(report[k]["pass"]["all"] for k in ("burst", "fairness", "cost"))
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
    started = [int(s["started_at"]) for s in statuses.values() if s["started_at"]]
    finished = [int(s["finished_at"]) for s in statuses.values() if s["finished_at"]]
    durations = [
        int(s["finished_at"]) - int(s["started_at"]) for s in statuses.values() if s["started_at"] and s["finished_at"]
    ]
    span_s = (max(finished) - min(started)) / 1000 if started and finished else None
    throughput = opts.burst_jobs / span_s if span_s else None
    measured_s = (_median(durations) or 0) / 1000 or stream_s

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
    progress(f"cost: {opts.cost_requests} one-delta requests through one worker, {cases}, {opts.cost_repeat} rounds")
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    states: dict[str, int] = {}
    async with fake_provider_process(api_key) as (base_url, _):
        for rnd in range(opts.cost_repeat):
            for name, limits in cases.items():  # alternating: a drift of the shared machine hits both
                run: _Run = new_run(f"cost-{name}-{rnd}", base_url, limits, extras.get(name, ""))
                async with _workers(1, run.config, api_key, tmp, f"cost-{name}-{rnd}") as (w,):
                    rids = [f"c-{i:05d}" for i in range(opts.cost_requests)]
                    before = _cpu(w.ps)
                    await _enqueue_all(run.client, [_job(scenario, x) for x in rids])
                    statuses = await _wait_terminal(r, run.keys, rids, opts.timeout_s)
                    cpu[name].append((_cpu(w.ps) - before) / opts.cost_requests * 1e6)
                await run.client.aclose()
                for k, v in _states(statuses).items():
                    states[k] = states.get(k, 0) + v
    best = {k: min(v) for k, v in cpu.items()}
    added = best["limited"] - best["unlimited"]
    budget_added = best["budgeted"] - best["unlimited"]
    out: dict[str, Any] = {
        "requests": opts.cost_requests,
        "rounds": opts.cost_repeat,
        "cpu_us_per_request": best,
        "cpu_us_per_request_all": cpu,
        "added_us_per_request": added,
        "added_over_unlimited": added / best["unlimited"] if best["unlimited"] else None,
        "budget_added_us_per_request": budget_added,
        "budget_added_over_unlimited": budget_added / best["unlimited"] if best["unlimited"] else None,
        "states": states,
    }
    checks = {
        "added_at_most_10pct": out["added_over_unlimited"] is not None and out["added_over_unlimited"] <= 0.10,
        "budget_added_at_most_10pct": out["budget_added_over_unlimited"] is not None
        and out["budget_added_over_unlimited"] <= 0.10,
        "all_completed": states == {"completed": len(cases) * opts.cost_repeat * opts.cost_requests},
    }
    out["pass"] = {**checks, "all": all(checks.values())}
    progress(f"  {out}")
    return out

"""``sluice bench soak``: a long run at a steady rate, watching for what grows.

Rule: the fake provider, two workers of different sizes (``max_in_flight``), and ``sluice relay`` each run
as their own process on one key prefix; this process enqueues jobs at a steady rate for ``duration_s``
seconds and runs the relay's followers: clients that each follow a just-enqueued request over SSE to its
``event: end``, then the next. Retention and the jobs stream's trim interval are short, so per-request keys
expire and the jobs stream is trimmed many times during the run. Every ``sample_every_s`` seconds it reads
the RSS and open descriptors of each worker, the relay and the fake provider (psutil), Redis's
``used_memory``, the run's own keys (counted by ``SCAN MATCH`` on its unique prefix, never ``KEYS``), and the
jobs and terminal streams' lengths (``XLEN``). After the load it waits for every request's terminal, keeps
sampling through an idle spell (what the processes give back), and stops everything.

What is judged (a missed target is shown and recorded in ``pass``, never raised):

- **terminal once**: every enqueued request has exactly one entry on the terminal stream, and nothing was
  dead-lettered; ``all_completed``: each of those says ``completed``;
- **followers**: every follow answered 200 and ended with ``event: end`` after the request's whole log;
- **jobs stream bounded**: its length never passed ``2 × rate × (jobs_trim_interval + stream seconds) + 50``
  (what settles between two trims, twice over), and it is empty after the idle spell;
- **level**: over the last half of the load (``duration_s / 2`` to ``duration_s``), the least-squares slope
  of each worker's and the relay's RSS ≤ ``RSS_SLOPE_MAX_KIB_PER_MIN`` and of their descriptors within
  ±``FDS_SLOPE_MAX_PER_MIN``; the run's key count within ±``KEYS_SLOPE_MAX`` of the rate per minute (a key
  that never expires would add one per request); Redis's ``used_memory`` less the terminal stream's
  ``MEMORY USAGE`` within ±``REDIS_SLOPE_MAX_KIB_PER_MIN``, judged only when the server held no other key
  when the run began (``--redis-url`` unset starts a private one). The terminal stream grows by design: it is
  capped at ``MAXLEN ~ 1,000,000``, and its bytes per entry are reported so that cap's size is known.

The fake provider's RSS is reported, not judged: it keeps the last 100,000 requests' records by design.
``--quick``: 30 s at 5 jobs/s of 1.5 s streams, 5 followers, retention 5 s, trims every second; its slopes
are shown but say little (the processes are still warming up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import secrets
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from sluice.bench.e2e import (
    _KEY_ENV,
    ROOT,
    _cleanup,
    _cpu,
    _env,
    _free_port,
    _start_worker,
    _stop,
    _Worker,
    fake_provider_process,
    mean_event_size,
)
from sluice.client import SluiceClient
from sluice.schemas.keys import Keys
from sluice.schemas.replies import range_entries
from sluice.worker.redis.connect import AnyRedis, connect

__all__ = [
    "FDS_SLOPE_MAX_PER_MIN",
    "KEYS_SLOPE_MAX",
    "REDIS_SLOPE_MAX_KIB_PER_MIN",
    "RSS_SLOPE_MAX_KIB_PER_MIN",
    "SoakOptions",
    "run_soak",
    "slope_per_min",
]

#: RSS growth a process may show over the last half and still count as level: 50 KiB/min is 3 MiB an hour
RSS_SLOPE_MAX_KIB_PER_MIN = 50.0
#: descriptors: fewer than one more every two minutes (a leak per request would be hundreds a minute)
FDS_SLOPE_MAX_PER_MIN = 0.5
#: the run's key count may drift by this fraction of the requests per minute (one leaked key per request: 1.0)
KEYS_SLOPE_MAX = 0.05
#: Redis's used_memory, less the terminal stream, per minute
REDIS_SLOPE_MAX_KIB_PER_MIN = 64.0

_ROUTE = "anthropic"
_SECRET_ENV = "SLUICE_RELAY_SECRETS"


@dataclass(frozen=True, slots=True)
class SoakOptions:
    redis_url: str
    quick: bool = False
    duration_s: float = 3600.0
    rate: float = 15.0  # jobs enqueued per second (900 a minute)
    followers: int = 30
    max_in_flight: tuple[int, int] = (32, 160)  # the two workers
    deltas: int = 50
    pace_ms: int = 200  # 56 provider events, 55 gaps: 11 s a stream, so about 165 in flight
    retention_s: int = 120
    trim_interval_s: float = 60.0  # the default jobs_trim_interval
    sample_every_s: float = 10.0
    idle_s: float = 90.0  # after the last terminal: at least one trim, and what the processes give back
    seed: int = 7

    @staticmethod
    def for_run(
        redis_url: str,
        quick: bool,
        duration_s: float | None = None,
        rate: float | None = None,
        followers: int | None = None,
        seed: int = 7,
    ) -> SoakOptions:
        """The run's options: ``--quick`` sizes, then the retention, trim interval, sampling and idle spell
        scaled to the duration (60 minutes: 120 s, 60 s, 10 s, 90 s), so keys expire and the jobs stream is
        trimmed many times in a run of any length."""
        if quick:
            sizes: dict[str, Any] = {"duration_s": 30.0, "rate": 5.0, "followers": 5, "max_in_flight": (4, 16)}
            sizes |= {"deltas": 10, "pace_ms": 100}
        else:
            sizes = {}
        if duration_s is not None:
            sizes["duration_s"] = duration_s
        if rate is not None:
            sizes["rate"] = rate
        if followers is not None:
            sizes["followers"] = followers
        o = SoakOptions(redis_url, quick=quick, seed=seed, **sizes)
        if not (o.duration_s > 0 and o.rate > 0 and o.followers >= 0):
            raise ValueError("soak: --duration and --rate must be positive, --followers at least 0")
        trim = max(1.0, min(60.0, o.duration_s / 30))
        return dataclasses.replace(
            o,
            retention_s=max(5, min(120, int(o.duration_s / 6))),
            trim_interval_s=trim,
            sample_every_s=max(1.0, min(10.0, o.duration_s / 30)),
            idle_s=max(3.0, min(90.0, 1.5 * trim + 5)),
        )

    @property
    def scenario(self) -> str:
        return f"synthetic;deltas={self.deltas};pace_ms={self.pace_ms}"


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(seconds, value)`` points, per minute; None under three points."""
    if len(points) < 3:
        return None
    n = len(points)
    tm = sum(t for t, _ in points) / n
    ym = sum(y for _, y in points) / n
    var = sum((t - tm) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - tm) * (y - ym) for t, y in points) / var * 60


# -- processes ------------------------------------------------------------------------------------------------


def _write_config(path: Path, opts: SoakOptions, prefix: str, base_url: str, max_in_flight: int) -> None:
    lines = [
        f'redis_url = "{opts.redis_url}"',
        f'key_prefix = "{prefix}"',
        f"max_in_flight = {max_in_flight}",
        f"retention_seconds = {opts.retention_s}",
        f"jobs_trim_interval = {opts.trim_interval_s}",
        "shutdown_grace = 10.0",
        "claim_idle_ms = 60000",
        "[timeouts]",
        "connect = 10.0",
        "first_byte = 60.0",
        "idle = 120.0",
        "total = 3600.0",
        f'[routes."{_ROUTE}"]',
        'dialect = "anthropic"',
        f'base_url = "{base_url}"',
        'model = "synthetic"',
        f'api_key_env = "{_KEY_ENV}"',
        "send_request_id = true",
    ]
    path.write_text("\n".join(lines) + "\n")


@dataclass(slots=True)
class _Relay:
    proc: asyncio.subprocess.Process
    log: Path
    ps: psutil.Process
    url: str


@contextlib.asynccontextmanager
async def _relay_process(redis_url: str, prefix: str, secret: str, log: Path) -> AsyncIterator[_Relay]:
    """``sluice relay`` as an operator starts it (INFO logs, an access record per stream, JSON to a file)."""
    port = _free_port()
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sluice.cli.main",
            "relay",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--key-prefix",
            prefix,
            "--log-format",
            "json",
            cwd=ROOT,
            env=_env({_SECRET_ENV: secret}),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 30
        url = None
        while url is None:
            for line in log.read_bytes().splitlines():  # noqa: ASYNC240 - a small local file, polled
                if b"listening on" in line:
                    url = str(json.loads(line)["url"])
            if url is None:
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the relay did not start; its log: {log}")
                await asyncio.sleep(0.05)
        yield _Relay(proc, log, psutil.Process(proc.pid), url)
    finally:
        await _stop(proc)


def _log_problems(log: Path) -> dict[str, Any]:
    """The warnings and errors of a JSON-lines log (a line that is not JSON counts as an error: a
    traceback), and the first few messages."""
    counts: Counter[str] = Counter()
    first: list[str] = []
    for line in log.read_bytes().splitlines():
        try:
            rec = json.loads(line)
            level, msg = str(rec.get("level", "")), str(rec.get("msg", ""))
        except ValueError:
            level, msg = "error", line.decode(errors="replace")[:200]
        if level in ("warning", "error", "critical"):
            counts[level] += 1
            if len(first) < 5 and msg not in first:
                first.append(msg)
    return {"counts": dict(counts), "first": first}


# -- sampling ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Samples:
    t: list[float] = field(default_factory=list)  # seconds since the first enqueue
    procs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # name -> [(rss bytes, fds)]
    cpu: dict[str, float] = field(default_factory=dict)  # name -> CPU seconds at the last sample
    redis: list[dict[str, int]] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)  # the fake provider's open streams


async def _count_keys(r: AnyRedis, prefix: str) -> int:
    n = 0
    async for _ in r.scan_iter(match=f"{prefix}:*", count=1000):
        n += 1
    return n


async def _redis_sample(r: AnyRedis, keys: Keys, prefix: str) -> dict[str, int]:
    memory = await r.info("memory")
    keyspace = await r.info("keyspace")
    async with r.pipeline(transaction=False) as p:
        p.xlen(keys.jobs)
        p.xlen(keys.terminal)
        p.memory_usage(keys.terminal)
        jobs, terminal, terminal_bytes = await p.execute()
    return {
        "used_memory": int(memory["used_memory"]),
        "server_keys": sum(int(v["keys"]) for v in keyspace.values() if isinstance(v, dict)),
        "run_keys": await _count_keys(r, prefix),
        "jobs_xlen": int(jobs),
        "terminal_xlen": int(terminal),
        "terminal_bytes": int(terminal_bytes or 0),
    }


async def _fake_in_flight(http: httpx.AsyncClient, fake_url: str) -> int:
    try:
        resp = await http.get(f"{fake_url}/_fake/stats", params={"requests": "0"})
        return int(resp.json()["counters"]["active_streams"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


async def _sample(
    procs: dict[str, psutil.Process],
    r: AnyRedis,
    keys: Keys,
    prefix: str,
    fake_url: str,
    t0: float,
    every_s: float,
    out: _Samples,
    stop: asyncio.Event,
) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            out.t.append(time.monotonic() - t0)
            for name, ps in procs.items():
                rows = out.procs.setdefault(name, [])
                try:
                    rows.append((ps.memory_info().rss, ps.num_fds()))
                    out.cpu[name] = _cpu(ps)
                except psutil.NoSuchProcess:  # reported as died by the run; its last reading stands
                    rows.append(rows[-1] if rows else (0, 0))
            out.redis.append(await _redis_sample(r, keys, prefix))
            out.in_flight.append(await _fake_in_flight(http, fake_url))
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


# -- load -------------------------------------------------------------------------------------------------------


def _job(scenario: str, rid: str) -> dict[str, Any]:
    return {
        "route": _ROUTE,
        "model": scenario,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "soak"}]},
    }


async def _enqueue_steadily(
    client: SluiceClient, opts: SoakOptions, t0: float, rids: list[str], lateness: list[float]
) -> None:
    """One job every ``1 / rate`` seconds on a fixed schedule from ``t0`` (a late one is sent at once, so
    the count stays exact); ``lateness`` gets the worst delay behind the schedule."""
    n = math.floor(opts.duration_s * opts.rate)
    worst = 0.0
    for i in range(n):
        due = t0 + i / opts.rate
        if (wait := due - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        else:
            worst = max(worst, -wait)
        rid = f"soak-{i:07d}"
        await client.enqueue(_job(opts.scenario, rid))
        rids.append(rid)
    lateness.append(worst)


@dataclass(slots=True)
class _Follows:
    outcomes: Counter[str] = field(default_factory=Counter)
    events: int = 0
    follows: int = 0
    short: list[tuple[str, int]] = field(default_factory=list)  # (request id, events) of ends before the log's end


async def _follower(
    relay_url: str,
    secret: str,
    rids: list[str],
    expected: int,
    timeout_s: float,
    rng: random.Random,
    out: _Follows,
    stop: asyncio.Event,
) -> None:
    """Follow one of the last five requests enqueued to its end, then the next, until ``stop``."""
    headers = {"Authorization": f"Bearer {secret}", "Accept": "text/event-stream"}
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0), limits=limits) as http:
        while not stop.is_set():
            if not rids:
                await asyncio.sleep(0.05)
                continue
            rid = rng.choice(rids[-5:])
            out.follows += 1
            events, ended = 0, False
            try:
                async with asyncio.timeout(timeout_s):
                    async with http.stream("GET", f"{relay_url}/v1/requests/{rid}/events", headers=headers) as resp:
                        if resp.status_code != 200:
                            out.outcomes[f"status {resp.status_code}"] += 1
                            continue
                        async for line in resp.aiter_lines():
                            if line.startswith("id: "):
                                events += 1
                            elif line == "event: end":
                                ended = True
                                break
            except TimeoutError:
                out.outcomes["timed out"] += 1
                continue
            except httpx.HTTPError as exc:
                out.outcomes[f"error {type(exc).__name__}"] += 1
                continue
            out.events += events
            if not ended:
                out.outcomes["closed before end"] += 1
            elif events != expected:
                out.outcomes["ended short"] += 1
                out.short.append((rid, events))
            else:
                out.outcomes["whole log"] += 1


async def _wait_terminals(r: AnyRedis, keys: Keys, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await r.xlen(keys.terminal) >= n or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.5)


async def _terminals(r: AnyRedis, keys: Keys) -> tuple[Counter[str], Counter[str]]:
    """(terminal entries per request id, their statuses) over the whole terminal stream."""
    per_request: Counter[str] = Counter()
    states: Counter[str] = Counter()
    start = "-"
    while True:
        batch = range_entries(await r.xrange(keys.terminal, start, "+", count=1000))
        for _, fields in batch:
            per_request[fields[b"request_id"].decode()] += 1
            states[fields[b"status"].decode()] += 1
        if len(batch) < 1000:
            return per_request, states
        start = "(" + batch[-1][0].decode()


# -- the run ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    """What one soak started and what it saw."""

    opts: SoakOptions
    prefix: str
    keys: Keys
    secret: str
    stream_s: float
    expected_events: int
    workers: dict[str, _Worker] = field(default_factory=dict)
    samples: _Samples = field(default_factory=_Samples)
    follows: _Follows = field(default_factory=_Follows)
    rids: list[str] = field(default_factory=list)
    lateness: list[float] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)  # load, drained: seconds since the first enqueue
    died: dict[str, int | None] = field(default_factory=dict)


async def run_soak(opts: SoakOptions, progress: Any = lambda _: None) -> dict[str, Any]:
    """The soak; returns its measurements and pass flags (see the module docstring)."""
    api_key = f"bench-{uuid.uuid4().hex}"
    prefix = f"sluice-bench:{uuid.uuid4().hex[:8]}:soak"
    _, expected_events, provider_events = mean_event_size("anthropic", opts.scenario)
    run = _Run(
        opts,
        prefix,
        Keys(prefix),
        secrets.token_hex(16),
        stream_s=(provider_events - 1) * opts.pace_ms / 1000,  # the fake sleeps between events
        expected_events=expected_events,
    )
    r = connect(opts.redis_url, cluster=False)
    try:
        other_keys_at_start = (await _redis_sample(r, run.keys, prefix))["server_keys"]
        with tempfile.TemporaryDirectory(prefix="sluice-bench-soak-") as d:
            tmp = Path(d)
            async with contextlib.AsyncExitStack() as stack:
                fake_url, fake_pid = await stack.enter_async_context(fake_provider_process(api_key))
                for i, slots in enumerate(opts.max_in_flight):
                    cfg = tmp / f"worker-{i}.toml"
                    _write_config(cfg, opts, prefix, fake_url, slots)
                    w = await _start_worker(cfg, tmp / f"worker-{i}.log", api_key, None, None)
                    stack.push_async_callback(_stop, w.proc)
                    run.workers[f"worker-{'ab'[i]}"] = w
                relay = await stack.enter_async_context(
                    _relay_process(opts.redis_url, prefix, run.secret, tmp / "relay.log")
                )
                client = SluiceClient(opts.redis_url, key_prefix=prefix, retention_seconds=opts.retention_s)
                stack.push_async_callback(client.aclose)
                procs = {n: w.ps for n, w in run.workers.items()} | {"relay": relay.ps}
                procs["fake-provider"] = psutil.Process(fake_pid)
                progress(
                    f"soak: {opts.duration_s:g} s at {opts.rate:g} jobs/s of {opts.scenario} (~{run.stream_s:.1f} s "
                    f"each), workers max_in_flight {opts.max_in_flight}, {opts.followers} followers, retention "
                    f"{opts.retention_s} s, jobs_trim_interval {opts.trim_interval_s:g} s, prefix {prefix}"
                )
                await _load(run, r, client, relay, procs, fake_url, progress)
                per_request, states = await _terminals(r, run.keys)
                dead_letters = await r.xlen(run.keys.dead_letters)
                exit_codes = {n: await _stop(w.proc) for n, w in run.workers.items()} | {
                    "relay": await _stop(relay.proc)
                }
                logs = {n: _log_problems(w.log) for n, w in run.workers.items()} | {"relay": _log_problems(relay.log)}
        report = _report(
            run,
            per_request,
            states,
            dead_letters,
            other_keys_at_start=other_keys_at_start,
            exit_codes=exit_codes,
            logs=logs,
        )
        report["key_prefix"] = prefix
        report["max_in_flight"] = dict(zip(run.workers, opts.max_in_flight, strict=True))
        return report
    finally:
        with contextlib.suppress(Exception):
            await _cleanup(r, prefix)
        await r.aclose()


async def _load(
    run: _Run,
    r: AnyRedis,
    client: SluiceClient,
    relay: _Relay,
    procs: dict[str, psutil.Process],
    fake_url: str,
    progress: Any,
) -> None:
    """The steady load with its followers and sampler, the drain, and the idle spell."""
    opts = run.opts
    follow_timeout = 3 * run.stream_s + 60
    t0 = time.monotonic()
    stop_load, stop_sampling = asyncio.Event(), asyncio.Event()
    rng = random.Random(opts.seed)
    sampler = asyncio.create_task(
        _sample(procs, r, run.keys, run.prefix, fake_url, t0, opts.sample_every_s, run.samples, stop_sampling)
    )
    followers = [
        asyncio.create_task(
            _follower(
                relay.url,
                run.secret,
                run.rids,
                run.expected_events,
                follow_timeout,
                random.Random(rng.random()),
                run.follows,
                stop_load,
            )
        )
        for _ in range(opts.followers)
    ]
    try:
        await _enqueue_steadily(client, opts, t0, run.rids, run.lateness)
        run.times["load"] = time.monotonic() - t0
        stop_load.set()
        progress(f"enqueued {len(run.rids)} in {run.times['load']:.1f} s; waiting for every terminal")
        await _wait_terminals(r, run.keys, len(run.rids), 3 * run.stream_s + 120)
        run.times["drained"] = time.monotonic() - t0
        if followers:  # each ends its follow (its request has ended) and stops
            _, late = await asyncio.wait(followers, timeout=follow_timeout + 10)
            if late:
                run.follows.outcomes["still following at the end"] += len(late)
        progress(f"drained at {run.times['drained']:.1f} s; idle for {opts.idle_s:g} s")
        await asyncio.sleep(opts.idle_s)
        run.died = {n: w.proc.returncode for n, w in run.workers.items() if w.proc.returncode is not None}
        if relay.proc.returncode is not None:
            run.died["relay"] = relay.proc.returncode
    finally:
        stop_load.set()
        for f in followers:
            f.cancel()
        stop_sampling.set()
        with contextlib.suppress(Exception):
            await sampler


def _report(
    run: _Run,
    per_request: Counter[str],
    states: Counter[str],
    dead_letters: int,
    *,
    other_keys_at_start: int,
    exit_codes: dict[str, int | None],
    logs: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    opts, s, follows, rids, died = run.opts, run.samples, run.follows, run.rids, run.died
    stream_s, expected_events = run.stream_s, run.expected_events
    t_load, t_drained = run.times["load"], run.times["drained"]
    lateness = run.lateness[0] if run.lateness else None
    half = [i for i, t in enumerate(s.t) if opts.duration_s / 2 <= t <= opts.duration_s]
    idle = len(s.t) - 1  # the last sample: after the idle spell

    def kib(b: int) -> float:
        return round(b / 1024, 1)

    processes: dict[str, Any] = {}
    for name, rows in s.procs.items():
        rss = [r for r, _ in rows]
        fds = [f for _, f in rows]
        load = [i for i, t in enumerate(s.t) if t <= t_load]
        processes[name] = {
            "rss_kib": {
                "first": kib(rss[0]),
                "max": kib(max(rss)),
                "end_of_load": kib(rss[load[-1]]) if load else None,
                "after_idle": kib(rss[idle]),
            },
            "rss_slope_kib_per_min": _round(slope_per_min([(s.t[i], rss[i] / 1024) for i in half])),
            "fds": {"first": fds[0], "max": max(fds), "after_idle": fds[idle]},
            "fds_slope_per_min": _round(slope_per_min([(s.t[i], fds[i]) for i in half]), 3),
            "cpu_s": round(s.cpu.get(name, 0.0), 2),
            "judged": name != "fake-provider",
        }
        if name in logs:
            processes[name]["log_problems"] = logs[name]
        if name in exit_codes:
            processes[name]["exit_code"] = exit_codes[name]
    red = s.redis
    used = [x["used_memory"] for x in red]
    less_terminal = [x["used_memory"] - x["terminal_bytes"] for x in red]
    jobs_bound = math.ceil(2 * opts.rate * (opts.trim_interval_s + stream_s)) + 50
    last = red[-1]
    redis: dict[str, Any] = {
        "other_keys_at_start": other_keys_at_start,
        "used_memory_max_kib": kib(max(used)),
        "used_memory_after_idle_kib": kib(used[idle]),
        "used_memory_slope_kib_per_min": _round(slope_per_min([(s.t[i], used[i] / 1024) for i in half])),
        "used_memory_less_terminal_slope_kib_per_min": _round(
            slope_per_min([(s.t[i], less_terminal[i] / 1024) for i in half])
        ),
        "terminal_slope_kib_per_min": _round(slope_per_min([(s.t[i], red[i]["terminal_bytes"] / 1024) for i in half])),
        "run_keys_max": max(x["run_keys"] for x in red),
        "run_keys_slope_per_min": _round(slope_per_min([(s.t[i], red[i]["run_keys"]) for i in half])),
        "jobs_xlen_max": max(x["jobs_xlen"] for x in red),
        "jobs_xlen_after_idle": last["jobs_xlen"],
        "jobs_xlen_bound": jobs_bound,
        "terminal_xlen_after_idle": last["terminal_xlen"],
        "terminal_bytes_per_entry": round(last["terminal_bytes"] / last["terminal_xlen"], 1)
        if last["terminal_xlen"]
        else None,
    }
    once = sum(1 for rid in rids if per_request.get(rid) == 1)
    extra = sorted(set(per_request) - set(rids))
    requests = {
        "enqueued": len(rids),
        "terminal_entries": sum(per_request.values()),
        "terminal_once": once,
        "missing": sum(1 for rid in rids if rid not in per_request),
        "more_than_once": sum(1 for rid in rids if per_request.get(rid, 0) > 1),
        "unknown": len(extra),
        "states": dict(states),
        "dead_letters": dead_letters,
        "enqueue_max_late_s": _round(lateness, 3),
    }
    judged = {n: p for n, p in processes.items() if p["judged"]}
    keys_limit = KEYS_SLOPE_MAX * opts.rate * 60
    used_slope = redis["used_memory_less_terminal_slope_kib_per_min"]
    checks: dict[str, bool | None] = {
        "terminal_once": once == len(rids) and not extra and dead_letters == 0,
        "all_completed": dict(states) == {"completed": len(rids)},
        "followers_whole_logs": (follows.follows > 0 and set(follows.outcomes) <= {"whole log"})
        if opts.followers
        else None,
        "jobs_stream_bounded": redis["jobs_xlen_max"] <= jobs_bound and redis["jobs_xlen_after_idle"] == 0,
        "no_process_died": not died,
        "rss_level": all(
            p["rss_slope_kib_per_min"] is not None and p["rss_slope_kib_per_min"] <= RSS_SLOPE_MAX_KIB_PER_MIN
            for p in judged.values()
        ),
        "fds_level": all(
            p["fds_slope_per_min"] is not None and abs(p["fds_slope_per_min"]) <= FDS_SLOPE_MAX_PER_MIN
            for p in judged.values()
        ),
        "run_keys_level": redis["run_keys_slope_per_min"] is not None
        and abs(redis["run_keys_slope_per_min"]) <= keys_limit,
        # Judged only on a server that held nothing else: another user's writes are in used_memory too.
        "redis_memory_level": None
        if other_keys_at_start
        else used_slope is not None and abs(used_slope) <= REDIS_SLOPE_MAX_KIB_PER_MIN,
    }
    return {
        "quick": opts.quick,
        "duration_s": opts.duration_s,
        "rate_per_s": opts.rate,
        "followers": opts.followers,
        "scenario": opts.scenario,
        "nominal_stream_s": stream_s,
        "retention_seconds": opts.retention_s,
        "jobs_trim_interval": opts.trim_interval_s,
        "sample_every_s": opts.sample_every_s,
        "idle_s": opts.idle_s,
        "load_s": round(t_load, 2),
        "drained_at_s": round(t_drained, 2),
        "slope_window_s": [opts.duration_s / 2, opts.duration_s],
        "slope_samples": len(half),
        "thresholds": {
            "rss_slope_max_kib_per_min": RSS_SLOPE_MAX_KIB_PER_MIN,
            "fds_slope_max_per_min": FDS_SLOPE_MAX_PER_MIN,
            "run_keys_slope_max_per_min": keys_limit,
            "redis_slope_max_kib_per_min": REDIS_SLOPE_MAX_KIB_PER_MIN,
            "jobs_xlen_bound": jobs_bound,
        },
        "requests": requests,
        "followers_report": {
            "follows": follows.follows,
            "events": follows.events,
            "expected_events_per_request": expected_events,
            "outcomes": dict(follows.outcomes),
            "short": follows.short[:10],
        },
        "processes": processes,
        "redis": redis,
        "died": died,
        "samples": {
            "t": [round(t, 2) for t in s.t],
            "rss_kib": {n: [kib(r) for r, _ in rows] for n, rows in s.procs.items()},
            "fds": {n: [f for _, f in rows] for n, rows in s.procs.items()},
            "in_flight": s.in_flight,
            "redis": red,
        },
        "pass": {**checks, "all": all(v for v in checks.values() if v is not None)},
    }


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)

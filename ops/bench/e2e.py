"""Parts 2 and 3 of ``sluice bench``: the whole pipeline end to end, each piece in its own process.

Rule: the fake provider, the worker(s) and the consumer are separate processes on loopback, Redis is a
real server; the driver (this process) only enqueues, samples and cancels, so its own cost never counts
as the worker's. Every number is measured, never derived from settings:

- sustained normalized events/s: events the consumer received / (last receive - first receive);
- added latency: consumer receive time - the fake provider's send stamp (``stamp=1``) on text deltas,
  p50/p99/max, and separately for the first delta of each stream; the floor client's streams are read by
  the same consumer while it runs, so the floor's added latency (what the machine itself allows) is
  measured the same way in the same run;
- worker CPU µs per normalized event: the worker processes' CPU time (psutil) over the run / events; the
  same per request (and Redis CPU per request), with the commands Redis ran per request (``INFO
  commandstats``, a count that compares across runs on a noisy machine); the fake provider's CPU per
  event beside it, so a run shows whether the fake, not the worker, was what held it back;
- worker RSS: a baseline after a warm-up, the peak, and RSS per in-flight stream at the moment the fake
  provider had the most streams open;
- cancel-to-close: from ``SluiceClient.cancel`` to the fake provider seeing the client go away, and to
  the ``stream.error`` (cancelled) entry;
- the ceiling, in the same run before the worker starts: pipelined XADD of events of the run's mean
  encoded size to 1,000 streams from one process (redis-py asyncio, and hiredis-packed RESP);
- Redis memory per event: ``MEMORY USAGE`` of a sample of the run's requests (raw and events streams and
  status hash) over their normalized events, read before the keys are removed;
- on a Redis Cluster (``redis_cluster``): the jobs spread over ``job_shards`` shards, the appends through the
  routed pipes (``cluster_appends`` is only recorded: the worker ignores "redis-py" now), Redis CPU summed
  over every node (masters and replicas, each also reported) and the consumer reading each stream with
  its own blocking XREAD (one XREAD serves one slot there); no ceiling and no floor client (both write to one server);
- part 3 puts a throttling proxy (``sluice.bench.redis_ceiling.ThrottleProxy``) between the worker and Redis and
  watches the worker's RSS over time.

A profile of the worker (``py-spy`` attached, or the worker run under ``pyinstrument``) is summarized by
package and function so the lead can see where the CPU goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil

from sluice.bench.floor_client import floor_key
from sluice.bench.redis_ceiling import throttled, xadd_ceiling_redispy, xadd_ceiling_resp
from sluice.client import SluiceClient
from sluice.harness.fake.provider import OTLP_SINK
from sluice.harness.fake.render import render
from sluice.harness.fake.scenarios import build_script, parse_scenario
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import encode_event
from sluice.schemas.keys import Keys
from sluice.schemas.replies import read_entries
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import AnyRedis, connect

__all__ = ["E2EOptions", "mean_event_size", "run_e2e", "scenario_model", "summarize_pyspy"]

ROOT = Path(__file__).resolve().parents[2]
_KEY_ENV = "SLUICE_BENCH_API_KEY"


@dataclass(slots=True)
class E2EOptions:
    streams: int = 100
    pace_eps: float = 0.0  # provider events per second per stream; 0: flat out
    deltas: int = 400  # text deltas per stream
    tools: int = 0
    dialect: str = "anthropic"
    workers: int = 1
    http_client: str = "wire"  # the worker's upstream client (worker/http/)
    # "otlp": the worker exports traces and metrics to the fake provider's OTLP sink; "admin": the worker's
    # admin endpoint is on and its /metrics scraped every scrape_every_s seconds (one worker: one port; 0: never)
    telemetry: str = "none"
    scrape_every_s: float = 1.0
    warmup: int = 10
    cancel: int = 10  # streams cancelled after the run to time cancel-to-close (0: skip)
    ceiling: bool = True
    floor_client: bool = True  # run the same streams through sluice.bench.floor_client too
    ceiling_streams: int = 1000
    ceiling_commands: int = 100_000
    redis_delay_ms: float = 0.0  # part 3: each Redis reply to the worker held this long
    redis_bytes_per_s: int = 0  # part 3: and the reply rate capped (0: no cap)
    profile: str | None = None  # py-spy | pyinstrument
    profile_dir: Path | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster
    job_shards: int = 1
    cluster_appends: str = "pipe"  # the worker's cluster_appends: "pipe" or "redis-py"
    durability: str = "primary"  # or "replica": WAIT for one replica before each terminal status
    timeout: float = 600.0
    sample_interval: float = 0.1
    label: str = ""
    round: int = 0  # --rounds: which repetition of the case list this run belongs to (sluice.bench.pairs)


def scenario_model(
    opts: E2EOptions, seed: int | str, *, deltas: int | None = None, pace_ms: float | None = None
) -> str:
    """The fake provider scenario (the requested model name) of one benchmark stream (``seed`` may be the
    floor client's ``{i}`` template)."""
    parts = [
        "synthetic",
        f"deltas={deltas if deltas is not None else opts.deltas}",
        "words=3-8",
        "stamp=1",
        f"seed={seed}",
    ]
    if opts.tools:
        parts.append(f"tools={opts.tools}")
    pace = pace_ms if pace_ms is not None else (1000.0 / opts.pace_eps if opts.pace_eps else 0.0)
    if pace:
        parts.append(f"pace_ms={pace:g}")
    return ";".join(parts)


def mean_event_size(dialect: str, model: str) -> tuple[float, int, int]:
    """(mean encoded contract event bytes, contract events, provider events) of one stream of ``model``,
    normalized locally: what the worker will append per event."""
    script = build_script(parse_scenario(model))
    events = render(dialect, script)
    raw, out, _ = normalize_bytes(
        [b"".join(events)], dialect, StreamInfo("req_bench0000000000000000:1", "req_bench0000000000000000", "", dialect)
    )
    sizes = [len(encode_event(e)) for e in out]
    return sum(sizes) / len(sizes), len(out), len(raw)


# -- processes ------------------------------------------------------------------------------------------------


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("REDIS_URL", None)  # the config file says where Redis is
    env.update(extra or {})
    return env


async def _readline(stream: asyncio.StreamReader | None, seconds: float, what: str) -> str:
    assert stream is not None
    try:
        line = await asyncio.wait_for(stream.readline(), seconds)
    except TimeoutError:
        raise RuntimeError(f"{what} did not start within {seconds:g}s") from None
    if not line:
        raise RuntimeError(f"{what} exited before it was ready")
    return line.decode().strip()


@contextlib.asynccontextmanager
async def fake_provider_process(api_key: str, extra_args: Sequence[str] = ()) -> AsyncIterator[tuple[str, int]]:
    """The fake provider in its own process; yields (base URL, pid). ``extra_args``: its options (limits)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sluice.harness.fake.provider",
        "--port",
        "0",
        *extra_args,
        cwd=ROOT,
        env=_env({"SLUICE_FAKE_API_KEY": api_key}),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        url = await _readline(proc.stdout, 20, "the fake provider")
        yield url, proc.pid
    finally:
        await _stop(proc)


async def _stop(proc: asyncio.subprocess.Process, sig: int = signal.SIGTERM, grace: float = 30) -> int | None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode


def _write_config(
    path: Path,
    redis_url: str,
    prefix: str,
    base_url: str,
    max_in_flight: int,
    http_client: str = "wire",
    telemetry: str = "none",
    opts: E2EOptions | None = None,
    admin_port: int | None = None,
) -> None:
    from sluice.harness.fake.render import DIALECTS

    cluster: list[str] = []
    if opts is not None and opts.redis_cluster:
        cluster = [
            "redis_cluster = true",
            f"job_shards = {opts.job_shards}",
            f'cluster_appends = "{opts.cluster_appends}"',
        ]
    if opts is not None and opts.durability != "primary":
        cluster.append(f'durability = "{opts.durability}"')
    lines = [
        f'redis_url = "{redis_url}"',
        f'key_prefix = "{prefix}"',
        f"max_in_flight = {max_in_flight}",
        f'http_client = "{http_client}"',
        *cluster,
        *([f"admin_port = {admin_port}"] if admin_port else []),
        "shutdown_grace = 10.0",
        "claim_idle_ms = 600000",
        "[timeouts]",
        "connect = 10.0",
        "first_byte = 60.0",
        "idle = 120.0",
        "total = 3600.0",
    ]
    if telemetry == "otlp":
        # Every span and metric really exported, over HTTP, to a sink in the fake provider's process; metrics
        # every 10 s (the default is 60) so a run of seconds pays for exports as a long one does.
        lines += [
            "[telemetry]",
            'exporter = "otlp"',
            f'otlp_endpoint = "{base_url}{OTLP_SINK}"',
            "metric_interval_ms = 10000",
        ]
    for d in DIALECTS:
        lines += [
            f'[routes."{d}"]',
            f'dialect = "{d}"',
            f'base_url = "{base_url}"',
            'model = "synthetic"',
            f'api_key_env = "{_KEY_ENV}"',
            "send_request_id = true",
        ]  # the fake tells requests apart by it
    path.write_text("\n".join(lines) + "\n")


def _free_port() -> int:
    from sluice.harness.embedded_redis import free_port

    return free_port()


async def _scrape(port: int, stop: asyncio.Event, codes: Counter[int], every_s: float = 1.0) -> None:
    """GET the worker's /metrics every ``every_s`` seconds, as Prometheus would (counts the answers by status)."""
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            try:
                codes[(await http.get(f"http://127.0.0.1:{port}/metrics")).status_code] += 1
            except httpx.HTTPError:
                codes[0] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


@dataclass(slots=True)
class _Worker:
    proc: asyncio.subprocess.Process
    log: Path
    ps: psutil.Process
    consumer: str  # as its "worker started" record names it: the status records' ``worker``


async def _start_worker(
    config: Path, log: Path, api_key: str, profile: str | None, profile_out: Path | None
) -> _Worker:
    cmd = [sys.executable, "-m", "sluice.worker", "--config", str(config)]
    if profile == "pyinstrument" and profile_out is not None:
        cmd = [
            sys.executable,
            "-m",
            "pyinstrument",
            "--renderer",
            "text",
            "--outfile",
            str(profile_out),
            "-m",
            "sluice.worker",
            "--config",
            str(config),
        ]
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=ROOT, env=_env({_KEY_ENV: api_key}), stdout=asyncio.subprocess.DEVNULL, stderr=err
        )
    deadline = time.monotonic() + 30
    while (consumer := _started_as(log.read_bytes())) is None:  # noqa: ASYNC240 - a small local file, polled
        if proc.returncode is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not start; its log: {log}")
        await asyncio.sleep(0.05)
    # Under pyinstrument the worker module runs inside the pyinstrument process: the same pid.
    return _Worker(proc, log, psutil.Process(proc.pid), consumer)


def _started_as(log: bytes) -> str | None:
    """The consumer name of the worker's "worker started" record (its JSON log line, once whole); None
    before it is written."""
    for line in log.splitlines(keepends=True):
        if b"worker started" in line and line.endswith(b"\n"):
            return str(json.loads(line)["consumer"])
    return None


def _cpu(ps: psutil.Process) -> float:
    """CPU seconds of the process, threads that exited included, as Linux's scheduler counts them (to the
    nanosecond): the process's own CPU clock (clock_gettime of the clock id glibc's ``clock_getcpuclockid`` makes,
    which Python does not wrap). Why not the threads' /proc counters: a thread that lived between two
    readings would cost nothing, and the process's user + system ticks, less the live threads', can shrink
    between readings (the kernel rounds each separately), which made a short run's CPU negative."""
    try:
        return time.clock_gettime(_process_clock(ps.pid))
    except (OSError, OverflowError):
        if not ps.is_running():
            raise psutil.NoSuchProcess(ps.pid) from None
        t = ps.cpu_times()
        return float(t.user + t.system)


def _process_clock(pid: int) -> int:
    """Linux's CPU clock id of process ``pid`` (MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED))."""
    return ((~pid) << 3) | 2


def _main_thread_cpu(ps: psutil.Process) -> float:
    """CPU seconds of the process's main thread alone (the worker's event loop, the admin endpoint's too)."""
    try:
        return _run_ns(Path(f"/proc/{ps.pid}/task/{ps.pid}")) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _run_ns(task: Path) -> int:
    """Nanoseconds a thread (``/proc/PID/task/TID``) has run on a CPU, as the scheduler counts them."""
    return int((task / "schedstat").read_text().split()[0])


async def _redis_calls(r: AnyRedis) -> Counter[str]:
    """Commands the Redis server has run, by name, summed over every node (``INFO commandstats``: the
    commands a script calls count too)."""
    if isinstance(r, SluiceCluster):
        infos = list((await r.info("commandstats", target_nodes=SluiceCluster.ALL_NODES)).values())
    else:
        infos = [await r.info("commandstats")]
    calls: Counter[str] = Counter()
    for info in infos:
        for name, stat in info.items():
            if name.startswith("cmdstat_"):
                calls[name.removeprefix("cmdstat_")] += int(stat["calls"])
    return calls


async def _redis_cpu(r: AnyRedis) -> float:
    """CPU seconds the Redis server has used (its own ``INFO cpu``: right for a remote server too; the
    warm-up and other clients of a shared server count as well); on a cluster, summed over every node."""
    return sum((await _redis_cpu_by_node(r)).values())


async def _redis_cpu_by_node(r: AnyRedis) -> dict[str, float]:
    if isinstance(r, SluiceCluster):
        infos: dict[str, Any] = await r.info("cpu", target_nodes=SluiceCluster.ALL_NODES)
    else:
        infos = {"server": await r.info("cpu")}
    return {node: float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for node, i in infos.items()}


async def _redis_memory(r: AnyRedis, keys: Keys, rids: list[str], sample: int = 200) -> dict[str, Any]:
    """Redis memory of a sample of requests (raw and events streams, status hash), per request and per
    normalized event, read with MEMORY USAGE (SAMPLES 0: every element)."""
    total = events = 0
    picked = rids[:: max(1, len(rids) // sample)][:sample]
    for rid in picked:
        rk = keys.request(rid)
        for key in (rk.raw, rk.events, rk.status):
            total += int(await r.memory_usage(key, samples=0) or 0)
        events += int(await r.xlen(rk.events))
    if not picked or not events:
        return {}
    return {
        "redis_bytes_per_request": total / len(picked),
        "redis_bytes_per_event": total / events,
        "redis_memory_sample_requests": len(picked),
    }


def _cpu_or(ps: psutil.Process, fallback: float) -> float:
    try:
        return _cpu(ps)
    except psutil.NoSuchProcess:
        return fallback


async def _consume_unless_a_worker_dies(
    consumer: asyncio.subprocess.Process, workers: list[_Worker]
) -> tuple[bytes, dict[str, Any] | None]:
    """The consumer's output; if a worker exits first, the consumer is stopped (it still reports what it
    counted) and the dead worker's exit code and last log lines are returned with it."""
    reading = asyncio.ensure_future(consumer.communicate())
    exits: dict[asyncio.Future[Any], _Worker] = {asyncio.ensure_future(w.proc.wait()): w for w in workers}
    done, _ = await asyncio.wait([reading, *exits], return_when=asyncio.FIRST_COMPLETED)
    died: dict[str, Any] | None = None
    if reading not in done:
        w = next(exits[t] for t in done if t in exits)
        tail = w.log.read_text(errors="replace").splitlines()[-12:]
        died = {"pid": w.proc.pid, "exit_code": w.proc.returncode, "log_tail": tail, "at": time.time()}
        consumer.send_signal(signal.SIGTERM)
    stdout, _ = await reading
    for t in exits:
        t.cancel()
    return stdout, died


# -- sampling ----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Samples:
    t: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    active: list[tuple[float, int]] = field(default_factory=list)  # (t, fake provider's active streams)
    cpu_last: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds at the last sample


async def _sample(workers: list[_Worker], fake_url: str, out: _Samples, interval: float, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        last_stats = 0.0
        while not stop.is_set():
            now = time.time()
            try:
                out.rss.append(sum(w.ps.memory_info().rss for w in workers))
                out.t.append(now)
                for w in workers:
                    out.cpu_last[w.ps.pid] = _cpu(w.ps)
            except psutil.NoSuchProcess:
                return
            if now - last_stats >= 1.0:
                last_stats = now
                try:
                    resp = await http.get(fake_url + "/_fake/stats")
                    out.active.append((now, int(resp.json()["counters"]["active_streams"])))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


# -- profiles ------------------------------------------------------------------------------------------------------

# Path prefix (as py-spy prints it: relative to the sys.path entry) -> the package it is charged to.
_BUCKETS = (
    ("httpx/", "httpx"),
    ("httpcore/", "httpcore"),
    ("h11/", "h11"),
    ("anyio/", "anyio"),
    ("redis/", "redis-py"),
    ("hiredis", "hiredis"),
    ("msgspec/", "msgspec"),
    ("normalizer/", "sluice normalizer"),
    ("worker/", "sluice worker"),
    ("schemas/", "sluice schemas"),
    ("ops/", "sluice ops"),
    ("asyncio/", "asyncio"),
    ("selectors.py", "asyncio"),
    ("ssl.py", "ssl"),
    ("socket.py", "socket"),
    ("logging/", "logging"),
)


def _bucket(frame: str) -> str:
    path = frame[frame.rfind("(") + 1 :].rstrip(")")
    for prefix, name in _BUCKETS:
        if path.startswith(prefix) or "/" + prefix in path:
            return name
    return "other"


def summarize_pyspy(raw: str, top: int = 20) -> dict[str, Any]:
    """Summarize py-spy ``--format raw`` output (``frame;frame;... count`` per line): samples, self time by
    package and the top functions by self and by inclusive time (percent of samples)."""
    self_fn: dict[str, int] = {}
    incl_fn: dict[str, int] = {}
    self_pkg: dict[str, int] = {}
    incl_pkg: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        n = int(count_s)
        total += n
        frames = [_strip_line(f) for f in stack.split(";")]
        leaf = frames[-1]
        self_fn[leaf] = self_fn.get(leaf, 0) + n
        self_pkg[_bucket(leaf)] = self_pkg.get(_bucket(leaf), 0) + n
        for f in set(frames):
            incl_fn[f] = incl_fn.get(f, 0) + n
        for b in {_bucket(f) for f in frames}:
            incl_pkg[b] = incl_pkg.get(b, 0) + n

    def pct(d: dict[str, int], k: int) -> list[tuple[str, float]]:
        return [(name, round(100 * c / total, 1)) for name, c in sorted(d.items(), key=lambda x: -x[1])[:k]]

    return {
        "samples": total,
        "self_by_package_pct": pct(self_pkg, 30),
        "inclusive_by_package_pct": pct(incl_pkg, 30),
        "top_self_pct": pct(self_fn, top) if total else [],
        # Inclusive time of sluice's own functions (the loop's and the CLI's root frames say nothing).
        "top_inclusive_sluice_pct": pct(
            {
                f: c
                for f, c in incl_fn.items()
                if _bucket(f).startswith("sluice ") and not f.startswith("<module>") and _bucket(f) != "sluice ops"
            },
            top,
        )
        if total
        else [],
    }


def _strip_line(frame: str) -> str:
    # "feed (normalizer/sse.py:123)" -> "feed (normalizer/sse.py)": aggregate a function over its lines.
    head, sep, tail = frame.rpartition(":")
    return head + ")" if sep and tail.rstrip(")").isdigit() else frame


async def _start_pyspy(pid: int, out: Path) -> asyncio.subprocess.Process | None:
    """py-spy attached to ``pid``, once it says it is sampling (a SIGINT before that would lose the
    profile); None when py-spy is not installed."""
    exe = Path(sys.executable).with_name("py-spy")
    cmd = str(exe) if exe.exists() else "py-spy"
    try:
        proc = await asyncio.create_subprocess_exec(
            cmd,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except FileNotFoundError:
        return None
    assert proc.stdout is not None
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.stdout.readline(), 10)  # "py-spy> Sampling process 250 times a second ..."
    return proc


# -- one run ----------------------------------------------------------------------------------------------------


async def _enqueue_all(client: SluiceClient, jobs: list[dict[str, Any]], concurrency: int = 64) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(job: dict[str, Any]) -> None:
        async with sem:
            await client.enqueue(job)

    async with asyncio.TaskGroup() as tg:
        for job in jobs:
            tg.create_task(one(job))


def _job(dialect: str, model: str, rid: str) -> dict[str, Any]:
    return {
        "route": dialect,
        "model": model,
        "request_id": rid,
        "request": {"messages": [{"role": "user", "content": "benchmark"}]},
    }


async def _cleanup(r: AnyRedis, prefix: str) -> None:
    if isinstance(r, SluiceCluster):  # one key per command: keys of different slots
        for key in [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]:
            await r.unlink(key)
        return
    batch: list[bytes] = []
    async for key in r.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            await r.unlink(*batch)
            batch = []
    if batch:
        await r.unlink(*batch)


async def _events_by_worker(r: AnyRedis, keys: Keys, rids: list[str]) -> dict[str, tuple[int, int]]:
    """Per worker (its consumer name): the requests it finished and their contract events, from the
    requests' status records (``worker``, ``event_count``)."""
    out: dict[str, tuple[int, int]] = {}
    for i in range(0, len(rids), 500):
        pipe = r.pipeline(transaction=False)
        for rid in rids[i : i + 500]:
            pipe.hmget(keys.request(rid).status, "worker", "event_count")
        for worker, count in await pipe.execute():
            name = worker.decode() if isinstance(worker, bytes) else str(worker)
            requests, events = out.get(name, (0, 0))
            out[name] = (requests + 1, events + int(count or 0))
    return out


def _side(telemetry: str, done: tuple[int, int], cpu_s: float, main_s: float) -> dict[str, Any]:
    requests, events = done
    return {
        "telemetry": telemetry,
        "requests": requests,
        "events": events,
        "worker_cpu_s": cpu_s,
        "worker_cpu_us_per_event": cpu_s / events * 1e6 if events else None,
        "worker_main_thread_cpu_us_per_event": main_s / events * 1e6 if events else None,
    }


async def _count_raw(r: AnyRedis, keys: Keys, rids: list[str]) -> int:
    total = 0
    for i in range(0, len(rids), 500):
        pipe = r.pipeline(transaction=False)
        for rid in rids[i : i + 500]:
            pipe.xlen(keys.request(rid).raw)
        total += sum(await pipe.execute())
    return total


async def _measure_cancel(
    client: SluiceClient, opts: E2EOptions, fake_url: str, run_id: str, limit_s: float = 30
) -> dict[str, Any]:
    """Start ``opts.cancel`` long paced streams, then cancel them one by one once each has delivered an
    event; time the upstream close (seen by the fake provider) and the cancelled terminal entry."""
    r = client.redis
    rids = [f"bench-{run_id}-cancel-{i}" for i in range(opts.cancel)]
    # 2,000 deltas at 20 ms: 40 s, never finished before the cancel; the fake provider renders a whole stream
    # up front, so a much longer one would stall its event loop and be timed instead of the worker.
    model = scenario_model(opts, 0, deltas=2000, pace_ms=20)
    for rid in rids:
        await client.enqueue(_job(opts.dialect, model, rid))
    to_close: list[float] = []
    to_terminal: list[float] = []
    # Every stream is flowing before the first cancel, so no other request's start is timed with it.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit_s):
            for rid in rids:
                while not await r.xlen(client.keys.request(rid).events):  # noqa: ASYNC110 - polling Redis
                    await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(timeout=10) as http:
        for rid in rids:
            key = client.keys.request(rid).events
            t0 = time.time()
            await client.cancel(rid)
            terminal_at = None
            last = "0-0"
            async with asyncio.timeout(limit_s):
                while terminal_at is None:
                    resp = await r.xread({key: last}, block=1000, count=1000)
                    for entry_id, f in read_entries(resp):
                        last = entry_id.decode()
                        if f.get(b"type") == b"stream.error":
                            terminal_at = time.time()
            to_terminal.append((terminal_at - t0) * 1000)
            closed_at = None
            async with asyncio.timeout(limit_s):
                while closed_at is None:
                    stats = (await http.get(fake_url + "/_fake/stats")).json()
                    rec = next((q for q in stats["requests"] if q.get("request_id") == rid), None)
                    if rec is not None and rec.get("outcome") != "open":
                        closed_at = rec.get("disconnected_at") or rec.get("ended_at")
                    else:
                        # The fake provider stamps the close itself; polling slowly keeps it unloaded.
                        await asyncio.sleep(0.1)
            to_close.append((closed_at - t0) * 1000)
    from sluice.bench.consumer import percentiles

    return {
        "streams": len(rids),
        "cancel_to_upstream_close_ms": percentiles(to_close),
        "cancel_to_terminal_ms": percentiles(to_terminal),
        "each_close_ms": [round(x, 2) for x in to_close],
        "each_terminal_ms": [round(x, 2) for x in to_terminal],
    }


def _raise_fd_limit() -> None:
    # A thousand streams need more descriptors than the usual soft limit; the child processes inherit it.
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


async def run_e2e(opts: E2EOptions, progress: Any = lambda _: None) -> dict[str, Any]:
    """One end-to-end case; returns its measurements (see the module docstring)."""
    _raise_fd_limit()
    run_id = uuid.uuid4().hex[:8]
    prefix = f"sluice-bench:{run_id}"
    keys = Keys(prefix, opts.job_shards, opts.redis_cluster)
    if opts.redis_cluster:  # both write to one server
        opts.ceiling = opts.floor_client = False
    api_key = f"bench-{uuid.uuid4().hex}"
    model0 = scenario_model(opts, 0)
    size, contract_per_stream, raw_per_stream = mean_event_size(opts.dialect, model0)
    result: dict[str, Any] = {
        "label": opts.label,
        "round": opts.round,
        "key_prefix": prefix,  # every key the run writes is under it, and gone when the run ends
        "dialect": opts.dialect,
        "streams": opts.streams,
        "pace_eps_per_stream": opts.pace_eps,
        "deltas_per_stream": opts.deltas,
        "workers": opts.workers,
        "http_client": opts.http_client,
        "telemetry": opts.telemetry,
        "scenario": model0,
        "expected_contract_events_per_stream": contract_per_stream,
        "expected_provider_events_per_stream": raw_per_stream,
        "mean_event_bytes": round(size, 1),
        "redis_delay_ms": opts.redis_delay_ms,
        "redis_bytes_per_s": opts.redis_bytes_per_s,
        "redis_cluster": opts.redis_cluster,
        "job_shards": opts.job_shards,
        "cluster_appends": opts.cluster_appends,
        "durability": opts.durability,
    }
    payload = b"x" * round(size)
    r = connect(opts.redis_url, cluster=opts.redis_cluster)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    try:
        if opts.ceiling:
            progress("ceiling: redis-py pipelined XADD to 1,000 streams")
            ceilings = [
                await xadd_ceiling_redispy(
                    opts.redis_url,
                    prefix,
                    streams=opts.ceiling_streams,
                    commands=opts.ceiling_commands,
                    payload=payload,
                ),
                await xadd_ceiling_resp(
                    opts.redis_url,
                    prefix,
                    streams=opts.ceiling_streams,
                    commands=opts.ceiling_commands,
                    payload=payload,
                ),
            ]
            result["ceiling"] = [c.to_json() for c in ceilings]
        async with contextlib.AsyncExitStack() as stack:
            fake_url, fake_pid = await stack.enter_async_context(fake_provider_process(api_key))
            worker_redis = opts.redis_url
            if opts.redis_delay_ms or opts.redis_bytes_per_s:
                proxy = await stack.enter_async_context(
                    throttled(opts.redis_url, delay_ms=opts.redis_delay_ms, bytes_per_s=opts.redis_bytes_per_s)
                )
                worker_redis = proxy.url
            result.update(
                await _run_case(opts, r, keys, prefix, run_id, api_key, fake_url, fake_pid, worker_redis, tmp, progress)
            )
            if opts.floor_client:
                progress("floor client: the same streams, plain sockets + hiredis-packed XADD")
                floor = await _run_floor_client(opts, r, prefix, api_key, fake_url, worker_redis, tmp)
                result["floor_client"] = floor
                us = result.get("worker_cpu_us_per_event")
                result["worker_over_floor_cpu"] = us / floor["cpu_us_per_event"] if us and floor["events"] else None
    finally:
        with contextlib.suppress(Exception):
            await _cleanup(r, prefix)
        await r.aclose()
        if not (opts.profile and opts.profile_dir is None):  # else the profile named in the result lives there
            shutil.rmtree(tmp, ignore_errors=True)
    return result


async def _run_case(
    opts: E2EOptions,
    r: AnyRedis,
    keys: Keys,
    prefix: str,
    run_id: str,
    api_key: str,
    fake_url: str,
    fake_pid: int,
    worker_redis: str,
    tmp: Path,
    progress: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # "a|b": side by side, one worker of each setting at once on the same jobs (sluice.bench.pairs)
    sides = opts.telemetry.split("|")
    if len(sides) > 1 and opts.workers != 1:
        raise ValueError("side-by-side telemetry ('a|b') runs one worker per setting: leave --workers at 1")
    if "admin" in sides and (opts.workers != 1 or sides.count("admin") > 1):
        raise ValueError("telemetry 'admin' runs one worker (the config names one admin port)")
    admin_port = _free_port() if "admin" in sides else None
    if len(sides) > 1 and opts.round % 2:
        sides.reverse()  # the worker started first reads first: each setting starts first every other round
    # Side by side, each worker takes at most its share of the streams at once, so both run as many.
    in_flight = max(opts.streams, opts.warmup, opts.cancel) + 16 if len(sides) == 1 else -(-opts.streams // len(sides))
    configs = []
    for i, side in enumerate(sides):
        configs.append(tmp / f"sluice{i}.toml")
        _write_config(
            configs[-1],
            worker_redis,
            prefix,
            fake_url,
            in_flight,
            opts.http_client,
            side,
            opts,
            admin_port if side == "admin" else None,
        )
    exports0 = await _otlp_exports(fake_url)
    profile_dir = opts.profile_dir or tmp
    profile_dir.mkdir(parents=True, exist_ok=True)
    pyinst_out = profile_dir / f"worker-{run_id}.pyinstrument.txt"
    n_workers = max(opts.workers, len(sides))
    progress(f"starting {n_workers} worker process(es)")
    workers = [
        await _start_worker(
            configs[i % len(configs)],
            tmp / f"worker{i}.log",
            api_key,
            opts.profile if i == 0 else None,
            pyinst_out if i == 0 else None,
        )
        for i in range(n_workers)
    ]
    client = SluiceClient(
        connect(opts.redis_url, cluster=opts.redis_cluster),
        key_prefix=prefix,
        job_shards=opts.job_shards if opts.job_shards > 1 else None,
    )
    try:
        if opts.warmup:
            progress(f"warm-up: {opts.warmup} streams")
            warm = [f"bench-{run_id}-warm-{i}" for i in range(opts.warmup)]
            await _enqueue_all(
                client,
                [
                    _job(opts.dialect, scenario_model(opts, 10_000 + i, deltas=20, pace_ms=0), rid)
                    for i, rid in enumerate(warm)
                ],
            )
            for rid in warm:
                await client.result(rid, timeout=60)
            if admin_port:  # the first scrape pays for what a first call imports and reads: the warm-up's cost
                async with httpx.AsyncClient(timeout=5) as http:
                    out["admin_warmup_scrape"] = (await http.get(f"http://127.0.0.1:{admin_port}/metrics")).status_code
            await asyncio.sleep(0.5)
        rss0 = sum(w.ps.memory_info().rss for w in workers)
        rids = [f"bench-{run_id}-{i}" for i in range(opts.streams)]
        consumer = await _start_consumer(opts, [keys.request(rid).events for rid in rids], tmp / "keys.txt")
        spy = None
        spy_out = profile_dir / f"worker-{run_id}.pyspy.txt"
        if opts.profile == "py-spy":
            spy = await _start_pyspy(workers[0].proc.pid, spy_out)
        samples = _Samples()
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(workers, fake_url, samples, opts.sample_interval, stop))
        scrapes: Counter[int] = Counter()
        scraper = None
        if admin_port:
            out["admin_scrape_every_s"] = opts.scrape_every_s  # 0: never scraped in the measured run
        if admin_port and opts.scrape_every_s > 0:
            scraper = asyncio.create_task(_scrape(admin_port, stop, scrapes, opts.scrape_every_s))
        cpus0 = [_cpu(w.ps) for w in workers]
        mains0 = [_main_thread_cpu(w.ps) for w in workers]
        cpu0, main0 = sum(cpus0), sum(mains0)
        fake_ps = psutil.Process(fake_pid)
        fake_cpu0 = _cpu(fake_ps)
        redis_cpu0 = await _redis_cpu_by_node(r)
        calls0 = await _redis_calls(r)
        t_enqueue = time.time()
        progress(
            f"run: {opts.streams} streams x {opts.deltas} deltas, "
            f"{'flat out' if not opts.pace_eps else f'{opts.pace_eps:g} events/s each'}"
        )
        try:
            await _enqueue_all(client, [_job(opts.dialect, scenario_model(opts, i), rid) for i, rid in enumerate(rids)])
            t_enqueued = time.time()
            stdout, died = await _consume_unless_a_worker_dies(consumer, workers)
            if died is not None:
                out["worker_died"] = died
                progress(f"a worker process exited during the run (code {died['exit_code']}); see worker_died")
            # A worker that died took its CPU counters with it: the last sample stands in.
            cpus1 = [_cpu_or(w.ps, samples.cpu_last.get(w.ps.pid, 0.0)) for w in workers]
            mains1 = [_main_thread_cpu(w.ps) for w in workers]
            cpu1, main1 = sum(cpus1), sum(mains1)
            fake_cpu1 = _cpu(fake_ps)
            redis_cpu1 = await _redis_cpu_by_node(r)
            calls1 = await _redis_calls(r)
            t_cpu1 = time.time()
        finally:
            stop.set()
            await sampler
            if scraper is not None:
                await scraper
                out["admin_scrapes"] = {str(code): n for code, n in scrapes.items()}
            if consumer.returncode is None:
                await _stop(consumer)
        if spy is not None:
            with contextlib.suppress(ProcessLookupError):  # py-spy exits by itself when the worker does
                spy.send_signal(signal.SIGINT)
            assert spy.stdout is not None
            said = (await asyncio.wait_for(spy.stdout.read(), 30)).decode(errors="replace")
            await asyncio.wait_for(spy.wait(), 30)
            if spy_out.exists():
                out["profile"] = {"tool": "py-spy", "file": str(spy_out), **summarize_pyspy(spy_out.read_text())}
            else:
                out["profile"] = {"tool": "py-spy", "error": said.strip()[-500:] or f"exit {spy.returncode}"}
        got = _consumer_result(stdout)
        events = int(got.get("events", 0))
        span = max(1e-9, got.get("last_recv", 0) - got.get("first_recv", 0))
        raw_entries = await _count_raw(r, keys, rids)
        out["consumer"] = got
        out["enqueue_s"] = t_enqueued - t_enqueue
        out["run_s"] = (got.get("last_recv") or time.time()) - t_enqueue
        out["events"] = events
        out["raw_entries"] = raw_entries
        out["events_per_s"] = events / span
        out["raw_per_s"] = raw_entries / span
        out["worker_cpu_s"] = cpu1 - cpu0
        out["worker_cpu_us_per_event"] = (cpu1 - cpu0) / events * 1e6 if events else None
        out["worker_main_thread_cpu_us_per_event"] = (main1 - main0) / events * 1e6 if events else None
        if len(sides) > 1:
            done_by = await _events_by_worker(r, keys, rids)
            out["sides"] = [
                _side(side, done_by.get(w.consumer, (0, 0)), cpus1[i] - cpus0[i], mains1[i] - mains0[i])
                for i, (side, w) in enumerate(zip(sides, workers, strict=True))
            ]
        # Share of one core over the same window the CPU times were taken in (enqueue to the last event).
        window = max(1e-9, t_cpu1 - t_enqueue)
        out["worker_cpu_util"] = (cpu1 - cpu0) / window
        out["fake_provider_cpu_util"] = (fake_cpu1 - fake_cpu0) / window
        # The fake provider must not be what limits a run: its CPU per event beside the worker's.
        out["fake_provider_cpu_us_per_event"] = (fake_cpu1 - fake_cpu0) / events * 1e6 if events else None
        redis_cpu = sum(redis_cpu1.values()) - sum(redis_cpu0.values())
        out["redis_cpu_util"] = redis_cpu / window
        out["redis_cpu_us_per_event"] = redis_cpu / events * 1e6 if events else None
        # The same CPU per request (its claim, status writes, finalize, publish and ack ride on it): compare
        # runs of one pace with short and long streams to split what a request costs from what an event does.
        out["worker_cpu_us_per_request"] = (cpu1 - cpu0) / len(rids) * 1e6
        out["redis_cpu_us_per_request"] = redis_cpu / len(rids) * 1e6
        # Commands Redis ran per request (the worker's, the producer's and the consumer's, scripts' own calls
        # included): a count, so it compares across runs on a noisy machine where CPU times do not.
        calls = calls1 - calls0
        calls.pop("info", None)  # the benchmark's own readings
        out["redis_calls_per_request"] = {k: round(n / len(rids), 2) for k, n in sorted(calls.items())}
        if opts.redis_cluster:  # each node's share of a core (masters and replicas)
            out["redis_cpu_util_by_node"] = {
                node: (cpu - redis_cpu0.get(node, cpu)) / window for node, cpu in redis_cpu1.items()
            }
        out.update(await _redis_memory(r, keys, rids))
        out["consumer_cpu_util"] = got.get("cpu_s", 0) / span
        out["load_avg_after"] = list(os.getloadavg())
        out.update(_memory(samples, rss0, [tuple(x) for x in got.pop("inflight_timeline", [])]))
        if opts.cancel and "worker_died" not in out:
            progress(f"cancel-to-close: {opts.cancel} streams")
            out["cancel"] = await _measure_cancel(client, opts, fake_url, run_id)
    finally:
        for w in workers:
            code = await _stop(w.proc)
            out.setdefault("worker_exit_codes", []).append(code)
        if opts.profile == "pyinstrument" and pyinst_out.exists():
            text = pyinst_out.read_text()
            out["profile"] = {"tool": "pyinstrument", "file": str(pyinst_out), "head": text[:6000]}
        await client.aclose()
    # Counted after the workers stopped: a stopping worker flushes what it had not exported yet.
    out["otlp_exports"] = await _otlp_exports(fake_url) - exports0
    return out


async def _otlp_exports(fake_url: str) -> int:
    """OTLP/HTTP POSTs the fake provider's sink has taken so far."""
    async with httpx.AsyncClient(timeout=5) as http:
        return int((await http.get(fake_url + "/_fake/stats")).json()["counters"]["otlp_exports"])


async def _start_consumer(opts: E2EOptions, keys: list[str], keys_file: Path) -> asyncio.subprocess.Process:
    """The consumer process (``sluice.bench.consumer``) following ``keys``, once it has said it is ready."""
    keys_file.write_text("\n".join(keys) + "\n")  # noqa: ASYNC240 - a small local file, before the run
    cluster = ["--cluster"] if opts.redis_cluster else []
    consumer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sluice.bench.consumer",
        "--redis-url",
        opts.redis_url,
        "--keys-file",
        str(keys_file),
        "--deadline",
        str(opts.timeout),
        *cluster,
        cwd=ROOT,
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
    )
    await _readline(consumer.stdout, 20, "the consumer")
    return consumer


def _consumer_result(stdout: bytes) -> dict[str, Any]:
    """The consumer's JSON document (its last line), or {} if it printed none."""
    return msgspec.json.decode(stdout.strip().splitlines()[-1]) if stdout.strip() else {}


async def _run_floor_client(
    opts: E2EOptions, r: AnyRedis, prefix: str, api_key: str, fake_url: str, redis_url: str, tmp: Path
) -> dict[str, Any]:
    """The floor client over the same streams, read while it runs by a consumer process of the same design
    as the worker case's, so its added latency is measured the same way, from the same stamps."""
    consumer = await _start_consumer(opts, [floor_key(prefix, i) for i in range(opts.streams)], tmp / "floor-keys.txt")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sluice.bench.floor_client",
            "--base-url",
            fake_url,
            "--dialect",
            opts.dialect,
            "--model-template",
            scenario_model(opts, "{i}"),
            "--streams",
            str(opts.streams),
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
            cwd=ROOT,
            env=_env({_KEY_ENV: api_key}),
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await asyncio.wait_for(proc.communicate(), opts.timeout)
        if proc.returncode != 0 or not stdout.strip():
            raise RuntimeError(f"the floor client failed (exit {proc.returncode})")
        # The consumer ends when it has read every stream's end marker (or at its deadline).
        got = _consumer_result((await asyncio.wait_for(consumer.communicate(), opts.timeout))[0])
    finally:
        if consumer.returncode is None:
            await _stop(consumer)
    out: dict[str, Any] = msgspec.json.decode(stdout.strip().splitlines()[-1])
    # What it counted must be what Redis holds, or its CPU per event would be per nothing. Each stream also
    # holds its end marker, which is not an event.
    stored = 0
    async for key in r.scan_iter(match=f"{prefix}:floor:*", count=1000):
        stored += await r.xlen(key)
    if stored - out["end_markers"] != out["events"]:
        raise RuntimeError(
            f"the floor client appended {stored} entries ({out['end_markers']} end markers) but counted"
            f" {out['events']} events"
        )
    out["latency_us"] = got.get("latency_us", {})
    out["first_delta_latency_us"] = got.get("first_delta_latency_us", {})
    out["consumer"] = {k: got.get(k) for k in ("events", "by_type", "terminals", "unfinished", "stopped_early")}
    return out


def _memory(s: _Samples, rss0: int, inflight: list[tuple[float, int]]) -> dict[str, Any]:
    """RSS figures. In-flight streams are counted by the consumer (started, not yet ended): the fake
    provider finishes writing a flat-out stream long before the worker has read it (socket buffers)."""
    if not s.rss:
        return {"rss_baseline_bytes": rss0}
    peak = max(s.rss)
    out: dict[str, Any] = {"rss_baseline_bytes": rss0, "rss_peak_bytes": peak, "rss_end_bytes": s.rss[-1]}
    if s.active:
        out["fake_provider_max_active_streams"] = max(a for _, a in s.active)
    if inflight:
        t_max, active = max(inflight, key=lambda x: x[1])
        # The RSS sample closest in time to the moment the most streams were in flight.
        i = min(range(len(s.t)), key=lambda k: abs(s.t[k] - t_max))
        out["max_inflight_streams"] = active
        out["rss_at_max_inflight_bytes"] = s.rss[i]
        out["rss_per_inflight_stream_kib"] = (s.rss[i] - rss0) / active / 1024 if active else None
    half = len(s.rss) // 2
    if half:
        out["rss_peak_first_half_bytes"] = max(s.rss[:half])
        out["rss_peak_second_half_bytes"] = max(s.rss[half:])
    return out

"""The worker's admin endpoint: a real worker (real Redis, the fake provider over loopback) with
``admin_port`` set, asked over HTTP as the kubelet and Prometheus ask.

Rule: /metrics is parsed with prometheus-client's own parser and its figures are checked against what the
test knows independently (the requests it enqueued and their results, the backlog it made); both formats
pass Prometheus' own linter (``promtool check metrics``, when it is on the PATH); /readyz follows draining
and Redis going away (a TcpProxy refusing), /healthz does not depend on Redis; nothing listens when the port
is unset. Every wait is on a condition.
"""

from __future__ import annotations

import contextlib
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import httpx
import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import parser as openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from sluice.harness.embedded_redis import free_port
from sluice.schemas.errors import ConfigError
from sluice.schemas.events import BlockDelta
from sluice.schemas.keys import Keys
from sluice.worker.capacity import gauges as route_gauges
from sluice.worker.config import Config
from sluice.worker.observability.telemetry import DISABLED
from sluice.worker.pipeline.consumer import Worker
from tests.faults.tcp_proxy import TcpProxy
from tests.integration.conftest import cleanup, client_for, make_config

pytestmark = pytest.mark.asyncio

ROUTE = {"route": "anthropic", "dialect": "anthropic"}
_WAIT_S = 30.0
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _config(redis_url: str, prefix: str, base_url: str, **overrides: object) -> Config:
    return make_config(redis_url, prefix, base_url, admin_port=free_port(), heartbeat_ms=200, **overrides)


@contextlib.asynccontextmanager
async def _running(config: Config) -> AsyncIterator[tuple[Worker, httpx.AsyncClient]]:
    worker = Worker(config)
    async with anyio.create_task_group() as tg, httpx.AsyncClient(timeout=5) as http:
        ready = anyio.Event()
        tg.start_soon(lambda: worker.run(ready=ready.set))
        await ready.wait()
        assert worker.admin.address is not None
        host, port = worker.admin.address
        http.base_url = httpx.URL(f"http://{host}:{port}")
        try:
            yield worker, http
        finally:
            worker.stop()


async def _until(probe: Callable[[], Any], what: str) -> Any:
    """Poll ``probe`` (async) until it returns something truthy (the endpoint is asked over HTTP: there is
    no event to wait on)."""
    try:
        with anyio.fail_after(_WAIT_S):
            while not (got := await probe()):  # noqa: ASYNC110
                await anyio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")
    return got


async def _scrape(http: httpx.AsyncClient) -> Samples:
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def _sum(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _labels(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls) in samples if n == name]


async def _status(http: httpx.AsyncClient, path: str) -> tuple[int, str]:
    r = await http.get(path)
    return r.status_code, r.text


async def test_metrics_under_load_count_what_finished_and_show_the_backlog(fake, redis_url, key_prefix, redis_client):
    config = _config(redis_url, key_prefix, fake.base_url, max_in_flight=2)
    n_ok, n_bad = 24, 3
    try:
        async with _running(config) as (_worker, http), client_for(config) as client:
            rids = [await client.enqueue(_job("synthetic;deltas=6;pace_ms=40")) for _ in range(n_ok)]
            rids += [await client.enqueue(_job("synthetic;deltas=2;status=400")) for _ in range(n_bad)]

            async def backlog() -> Samples | None:
                s = await _scrape(http)
                return s if _sum(s, "sluice_jobs_waiting", shard="0") > 0 else None

            seen = await _until(backlog, "a backlog in sluice_jobs_waiting")
            assert 1 <= _sum(seen, "sluice_jobs_pending", shard="0") <= n_ok + n_bad
            results = [await client.result(rid, timeout=60) for rid in rids]

            async def settled() -> Samples | None:
                s = await _scrape(http)
                drained = _sum(s, "sluice_jobs_waiting", shard="0") == 0 == _sum(s, "sluice_jobs_pending", shard="0")
                finished = _sum(s, "sluice_requests_terminal_total") == len(rids)
                return s if drained and finished and _sum(s, "sluice_redis_round_trip_seconds_count") else None

            samples = await _until(settled, "every request counted and the group drained")
    finally:
        await cleanup(redis_client, key_prefix)

    by_outcome = Counter((r.status, r.error.category if r.error else None) for r in results)
    assert by_outcome == {("completed", None): n_ok, ("failed", "invalid_request"): n_bad}
    assert _sum(samples, "sluice_requests_terminal_total", **ROUTE, status="completed", stop_reason="stop") == n_ok
    assert (
        _sum(samples, "sluice_requests_terminal_total", **ROUTE, status="failed", error_category="invalid_request")
        == n_bad
    )
    # One label set per family: a terminal without a stop reason or a category has it "".
    terminal_labels = _labels(samples, "sluice_requests_terminal_total")
    assert sorted(terminal_labels, key=lambda d: d["status"]) == [
        {**ROUTE, "status": "completed", "stop_reason": "stop", "error_category": ""},
        {**ROUTE, "status": "failed", "stop_reason": "", "error_category": "invalid_request"},
    ]
    # One first token per completed request, one first byte per attempt that got a body.
    assert _sum(samples, "sluice_attempt_time_to_first_token_seconds_count", **ROUTE) == n_ok
    assert _sum(samples, "sluice_attempt_time_to_first_byte_seconds_count", **ROUTE) >= n_ok
    assert _sum(samples, "sluice_stream_events_total", **ROUTE) > n_ok * 6
    assert _sum(samples, "sluice_provider_bytes_total", **ROUTE) > 0
    assert _sum(samples, "sluice_streams_in_flight", **ROUTE) == 0
    assert _labels(samples, "sluice_jobs_waiting") == [{"shard": "0"}]
    assert _sum(samples, "sluice_jobs_figures_age_seconds") < 60
    assert _sum(samples, "process_cpu_seconds_total") > 0 and _sum(samples, "process_resident_memory_bytes") > 1e6
    assert _sum(samples, "process_open_fds") > 0 and _labels(samples, "python_info")
    assert _labels(samples, "target_info") == [{"service_name": "sluice-worker", "service_instance_id": "w-test"}]
    assert "sluice_retries_total" not in {n for n, _ in samples}  # client errors are never retried


def _job(model: str) -> dict[str, Any]:
    return {"route": "anthropic", "model": model, "request": {"messages": [{"role": "user", "content": "hi"}]}}


async def test_readyz_is_503_while_draining_and_healthz_stays_200(fake, redis_url, key_prefix, redis_client):
    config = _config(redis_url, key_prefix, fake.base_url, shutdown_grace=30.0)
    try:
        async with _running(config) as (worker, http), client_for(config) as client:
            await _until(lambda: _ok(http, "/readyz"), "ready")
            assert await _status(http, "/healthz") == (200, "ok\n")
            rid = await client.enqueue(_job("synthetic;deltas=400;pace_ms=20"))
            await _until(lambda: _in_flight(worker), "the job in flight")
            worker.stop()  # what SIGTERM does
            code, text = await _status(http, "/readyz")
            assert (code, text) == (
                503,
                "draining: SIGTERM received, finishing the jobs in flight and taking no more\n",
            )
            assert await _status(http, "/healthz") == (200, "ok\n")
            await client.cancel(rid)  # the drain ends when the job does
            result = await client.result(rid, timeout=30)
    finally:
        await cleanup(redis_client, key_prefix)
    assert result.status in ("cancelled", "interrupted")  # before or after visible output


async def _ok(http: httpx.AsyncClient, path: str) -> bool:
    return (await http.get(path)).status_code == 200


async def _in_flight(worker: Worker) -> bool:
    return bool(worker.deps.inflight)


async def test_readyz_follows_redis_and_healthz_does_not(fake, redis_url, key_prefix, redis_client):
    async with TcpProxy.for_url(redis_url) as proxy:
        config = _config(proxy.url_for(redis_url), key_prefix, fake.base_url)
        try:
            async with _running(config) as (_worker, http), client_for(make_config(redis_url, key_prefix, "")) as c:
                await c.enqueue(_job("synthetic;deltas=1"))
                await _until(lambda: _ok(http, "/readyz"), "ready")
                before = await _until(_figures(http), "the group's figures")
                proxy.refuse()
                proxy.cut()

                async def unready() -> tuple[int, str] | None:
                    got = await _status(http, "/readyz")
                    return got if got[0] == 503 else None

                _code, text = await _until(unready, "/readyz 503")
                assert text.startswith("redis unreachable for ") and "ConnectionError" in text and "\n" not in text[:-1]
                assert await _status(http, "/healthz") == (200, "ok\n")
                during = await _scrape(http)  # answered from what the worker knows
                assert _labels(during, "sluice_jobs_pending") == _labels(before, "sluice_jobs_pending")
                proxy.refuse(False)
                await _until(lambda: _ok(http, "/readyz"), "ready again")
        finally:
            await cleanup(redis_client, key_prefix)


def _figures(http: httpx.AsyncClient) -> Callable[[], Any]:
    async def probe() -> Samples | None:
        s = await _scrape(http)
        return s if _labels(s, "sluice_jobs_pending") else None

    return probe


async def test_unknown_paths_and_methods(fake, redis_url, key_prefix, redis_client):
    config = _config(redis_url, key_prefix, fake.base_url)
    try:
        async with _running(config) as (_worker, http):
            assert (await http.get("/")).status_code == 404
            assert (await http.post("/healthz")).status_code == 405
    finally:
        await cleanup(redis_client, key_prefix)


async def test_silent_and_malformed_clients_hold_nothing_and_stop_closes_them(
    fake, redis_url, key_prefix, redis_client
):
    """The endpoint is served on the loop: a client that connects and sends nothing does not keep the
    probes waiting; a malformed request is a 400, an oversized head a 431, another method a 405 that
    closes; two requests share a kept-alive connection; HEAD has no body; stopping closes every connection
    and the port."""
    config = _config(redis_url, key_prefix, fake.base_url)

    async def raw(stream: anyio.abc.SocketStream, request: bytes, body: bytes = b"") -> bytes:
        """Send ``request``; what comes back up to the end of the head (and ``body`` after it)."""
        await stream.send(request)
        got = b""
        with anyio.fail_after(_WAIT_S):
            while b"\r\n\r\n" not in got or (body and not got.endswith(b"\r\n\r\n" + body)):
                got += await stream.receive()
        return got

    try:
        async with _running(config) as (worker, http):
            address = worker.admin.address
            assert address is not None
            silent = await anyio.connect_tcp(*address)
            assert (await http.get("/healthz")).status_code == 200
            async with await anyio.connect_tcp(*address) as bad:
                assert (await raw(bad, b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
            async with await anyio.connect_tcp(*address) as big:
                head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
                assert (await raw(big, head)).startswith(b"HTTP/1.1 431 ")
            async with await anyio.connect_tcp(*address) as post:
                answer = await raw(post, b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 405 ") and b"connection: close" in answer.lower()
                with anyio.fail_after(_WAIT_S), pytest.raises(anyio.EndOfStream):
                    while True:
                        await post.receive()
            async with await anyio.connect_tcp(*address) as kept:
                for _ in range(2):
                    answer = await raw(kept, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"ok\n")
                    assert answer.startswith(b"HTTP/1.1 200 ") and b"content-length: 3" in answer.lower()
                answer = await raw(kept, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")
        with anyio.fail_after(_WAIT_S), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
            while True:  # the worker has stopped: its end of the silent connection is closed
                await silent.receive()
        await silent.aclose()
        with pytest.raises(OSError):
            await anyio.connect_tcp(*address)
    finally:
        await cleanup(redis_client, key_prefix)


async def test_off_by_default_nothing_listens(fake, redis_url, key_prefix, redis_client):
    config = make_config(redis_url, key_prefix, fake.base_url)
    assert config.admin_port is None and Config().admin_host == "127.0.0.1"
    worker = Worker(config)
    assert worker.telemetry is DISABLED and worker.admin.registry is None
    try:
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()
            tg.start_soon(lambda: worker.run(ready=ready.set))
            await ready.wait()
            assert worker.admin.address is None
            worker.stop()
    finally:
        await cleanup(redis_client, key_prefix)


async def test_a_taken_port_is_one_line_naming_the_key(fake, redis_url, key_prefix, redis_client):
    with contextlib.closing(__import__("socket").socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(redis_url, key_prefix, fake.base_url, admin_port=port)
        with pytest.raises(ConfigError, match=rf"^admin_port {port}: cannot listen on 127\.0\.0\.1:{port} \(.+\)$"):
            await Worker(config).run()


async def test_the_archive_lag_is_a_metric(fake, redis_url, key_prefix, redis_client):  # type: ignore[no-untyped-def]
    """With ``archive_group`` set, the lag the worker's retention check read (the oldest terminal entry the
    archivers have not acked) is on /metrics, labelled with the group."""
    config = _config(redis_url, key_prefix, fake.base_url, archive_group="sluice-archive")
    terminal = Keys(key_prefix).terminal
    await redis_client.xgroup_create(terminal, "sluice-archive", id="0", mkstream=True)  # as an archiver does
    request = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        async with _running(config) as (_, http), client_for(config) as client:
            rid = await client.enqueue({"route": "anthropic", "model": "synthetic;deltas=2", "request": request})
            assert (await client.result(rid, timeout=30)).status == "completed"
            entry_ms = int((await redis_client.xrange(terminal))[0][0].split(b"-")[0])

            async def lag() -> list[float]:
                samples = await _scrape(http)
                return [
                    v
                    for (n, ls), v in samples.items()
                    if n == "sluice_archive_lag_seconds" and ("group", "sluice-archive") in ls
                ]

            (value,) = await _until(lag, "the archive lag on /metrics")
            seconds, micros = await redis_client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            # Not acked by any archiver: at least 0 when the check ran, at most the entry's age now.
            assert 0 <= value <= (now_ms - entry_ms) / 1000
    finally:
        await cleanup(redis_client, key_prefix)


PROMTOOL = shutil.which("promtool")
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


class _Families(Collector):
    """Families parsed from an OpenMetrics body, for prometheus-client to write again as the 0.0.4 text."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


async def _promtool(text: str) -> str:
    """``promtool check metrics`` on ``text``: its findings (empty when it passes; it exits 0 then)."""
    assert PROMTOOL is not None
    done = await anyio.run_process([PROMTOOL, "check", "metrics"], input=text.encode(), check=False)
    findings = (done.stdout + done.stderr).decode()
    assert (done.returncode == 0) == (findings == ""), (done.returncode, findings)
    return findings


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on the PATH (Debian's package prometheus has it)")
async def test_promtool_passes_the_text_as_served_and_the_openmetrics_families_rewritten(
    fake, redis_url, key_prefix, redis_client, monkeypatch
):
    """A worker with every family the endpoint has (a limited route's gauges, the archive lag, the latest
    GenAI names, a retry, a cancel): its 0.0.4 text passes ``promtool check metrics`` as served. promtool
    parses the 0.0.4 text only (an OpenMetrics counter's ``_total`` sample and an ``info`` family are not
    in that grammar), so the OpenMetrics body is parsed with prometheus-client's strict OpenMetrics parser
    and the families it holds, written again as the 0.0.4 text, pass promtool: the same names, types, units
    and help texts as the text body."""
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
    monkeypatch.setattr(route_gauges, "INTERVAL_S", 0.05)
    base = _config(redis_url, key_prefix, fake.base_url, archive_group="sluice-archive")
    routes = {**base.routes, "claude": msgspec.structs.replace(base.routes["anthropic"], max_concurrency=4)}
    config = msgspec.structs.replace(base, routes=routes)
    await redis_client.xgroup_create(Keys(key_prefix).terminal, "sluice-archive", id="0", mkstream=True)
    try:
        async with _running(config) as (_worker, http), client_for(config) as client:
            ok = await client.enqueue({**_job("synthetic;deltas=3"), "route": "claude"})
            retried = await client.enqueue(_job("synthetic;deltas=2;status=529;times=1;id=pt"))
            cancelled = await client.enqueue(_job("synthetic;deltas=400;pace_ms=20"))
            async for event in client.events(cancelled):
                if isinstance(event, BlockDelta):
                    break
            assert await client.cancel(cancelled)
            for rid in (ok, retried, cancelled):
                await client.result(rid, timeout=30)

            async def every_family() -> Samples | None:
                s = await _scrape(http)
                names = {n for n, _ in s}
                want = {
                    "sluice_route_admitted_total",
                    "sluice_archive_lag_seconds",
                    "sluice_retries_total",
                    "sluice_cancel_close_time_seconds_count",
                    "gen_ai_client_operation_time_to_first_chunk_seconds_count",
                    "sluice_redis_round_trip_seconds_count",
                }
                return s if want <= names else None

            await _until(every_family, "every family on /metrics")
            text = await http.get("/metrics")
            om = await http.get("/metrics", headers={"Accept": OPENMETRICS})
    finally:
        await cleanup(redis_client, key_prefix)
    assert text.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    om_type = "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
    assert om.headers["content-type"] == om_type
    assert text.headers["content-encoding"] == om.headers["content-encoding"] == "gzip"  # httpx asks for it
    assert await _promtool(text.text) == ""
    families = list(openmetrics.text_string_to_metric_families(om.text))  # strict: raises on any fault
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    rewritten = generate_latest(registry).decode()
    assert await _promtool(rewritten) == ""
    heads = {line for line in text.text.splitlines() if line.startswith("# ")}
    assert heads == {line for line in rewritten.splitlines() if line.startswith("# ")}

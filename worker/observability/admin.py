"""The worker's admin endpoint: ``GET /healthz``, ``/readyz`` and ``/metrics`` on ``admin_host:admin_port``.

Rule: a probe or a scrape never runs a Redis command and never waits for one. The loops tell ``Health``
what happened (the heartbeat loop's turns, each Redis answer or failure); a background poller reads XINFO
GROUPS (lag and pending per job shard) every few seconds and keeps the last figures; a request only reads
those. So a scrape answers from what the worker knows while Redis is away, and costs the hot path nothing
but reading the worker's own figures and the rendering.

- ``/healthz`` (liveness) never depends on Redis: it is answered on the event loop, so an answer proves the
  loop runs (a blocked loop answers nothing and the probe times out); 503 when the heartbeat loop, asleep
  between turns, has not woken within ``2 × heartbeat_ms + 1 s`` (a turn waiting on Redis is Redis's delay,
  not a stuck process).
- ``/readyz`` (readiness): 503 with a one-line reason while starting (the group not joined yet), while
  draining (SIGTERM received), when the last Redis command failed or none answered recently, or when the
  group is missing on a job shard and cannot be created. Ready as soon as the worker joined: its start
  created or found every group, and a poll that finds one missing afterwards creates it before it says so.
- ``/metrics``: prometheus-client's WSGI app (``make_wsgi_app``: the Prometheus text 0.0.4, OpenMetrics when
  asked, gzip when accepted) over a registry of this worker's own: the worker's prometheus-client
  instruments (``sluice.worker.observability.metrics``: every instrument of ``sluice.worker.observability.telemetry``
  and of any other home, this one's through ``Telemetry.observe`` and ``Telemetry.histogram``) and
  prometheus-client's ``ProcessCollector`` and ``PlatformCollector``.

The server is ``sluice.worker.observability.admin_http`` on the worker's event loop (why not a thread: there).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import anyio
from anyio.abc import Listener, SocketAttribute, SocketStream
from redis.exceptions import RedisError, ResponseError

from sluice.schemas.errors import ConfigError
from sluice.schemas.keys import Keys
from sluice.worker.config import Config
from sluice.worker.observability.admin_http import WSGIApp, serve
from sluice.worker.observability.telemetry import Reading, Recorder, Telemetry
from sluice.worker.redis.connect import AnyRedis, ensure_group

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from prometheus_client import CollectorRegistry

__all__ = ["ADMIN_METRICS", "Admin", "Health", "WorkerView"]

log = logging.getLogger("sluice.worker")

_SCOPE = "sluice.worker.observability.admin"
# XINFO GROUPS per shard this often: the heartbeat's and the route gauges' period. A poll is a Redis round
# trip, about 1 ms of a loaded worker's CPU (an idle worker's CPU rose 0.43 ms a second at 2 s).
_POLL_S = 5.0
_RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_ERRORS = (RedisError, OSError, RuntimeError, AttributeError)  # as the consumer's loops (redis-py's resets)

# Instrument name -> (kind, unit, description): what this module adds to telemetry's METRICS.
ADMIN_METRICS: dict[str, tuple[str, str, str]] = {
    "sluice.jobs.waiting": ("gauge", "{job}", "jobs not yet delivered to the group, per job shard (XINFO GROUPS lag)"),
    "sluice.jobs.pending": (
        "gauge",
        "{job}",
        "jobs delivered to the group's workers and not yet acked, per job shard (XINFO GROUPS pending)",
    ),
    "sluice.jobs.figures_age": ("gauge", "s", "seconds since the job figures were read from Redis"),
    "sluice.redis.round_trip": ("histogram", "s", "the heartbeat's membership write, sent to answered"),
}


class WorkerView(Protocol):
    """What the endpoint reads of the worker (``sluice.worker.pipeline.consumer.Worker``)."""

    @property
    def redis(self) -> AnyRedis: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def telemetry(self) -> Telemetry: ...
    @property
    def stopping(self) -> anyio.Event: ...


class Health:
    """What the worker's loops tell the probes (written and read on the event loop)."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._heartbeat_s = config.heartbeat_ms / 1000
        # Redis counts as answering while something answered within this (the slower of the two loops'
        # periods, twice, plus a command's own timeout).
        self._redis_fresh_s = 2 * max(self._heartbeat_s, _POLL_S) + config.redis_socket_timeout
        self.beat_started: float | None = None  # the heartbeat loop woke for a turn
        self.beat_done: float | None = None  # ... and finished it
        self.joined = False  # the worker started: groups ensured, membership announced
        self.redis_ok_at: float | None = None
        self.redis_down_since: float | None = None  # the first failure since the last answer
        self.redis_error = ""
        self.missing_group = ""  # a job stream without the group, as the poller last saw it
        self._rtt: Recorder | None = None  # the round-trip histogram, once the endpoint serves

    def heartbeat_started(self) -> float:
        """The heartbeat loop woke for a turn; returns the time (the round trip's start)."""
        self.beat_started = now = self.clock()
        return now

    def heartbeat_done(self) -> None:
        self.beat_done = self.clock()

    def started(self) -> None:
        """The worker joined its group (``Worker.run`` got past its start): its groups were just created or
        found and Redis answered, so it is ready now, whatever a poll that began before it saw."""
        self.joined = True
        self.missing_group = ""
        self.redis_answered()

    def redis_answered(self, sent_at: float | None = None) -> None:
        """Redis answered a command; ``sent_at``: when it was sent (records the round trip)."""
        self.redis_ok_at = now = self.clock()
        self.redis_down_since = None
        if sent_at is not None and self._rtt is not None:
            self._rtt.record(now - sent_at)

    def redis_failed(self, exc: BaseException) -> None:
        if self.redis_down_since is None:
            self.redis_down_since = self.clock()
        # The class and the first line: redis-py's messages name host and port, never the password.
        lines = str(exc).splitlines()
        self.redis_error = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]

    def liveness(self) -> str | None:
        """None when live, else the reason (one line). Asked on the event loop: that it runs is the answer."""
        now = self.clock()
        started, done = self.beat_started, self.beat_done
        asleep = started is not None and done is not None and done >= started  # between turns
        if asleep and done is not None and (late := now - done) > 2 * self._heartbeat_s + 1:
            return f"the heartbeat loop has not woken for {late:.1f} s (heartbeat_ms {self._heartbeat_s * 1000:g})"
        return None

    def readiness(self, draining: bool) -> str | None:
        """None when ready, else the reason (one line)."""
        if draining:
            return "draining: SIGTERM received, finishing the jobs in flight and taking no more"
        if not self.joined:
            return "starting: the consumer group is not joined yet"
        now = self.clock()
        if self.redis_down_since is not None:
            return f"redis unreachable for {now - self.redis_down_since:.1f} s ({self.redis_error})"
        if self.redis_ok_at is None or now - self.redis_ok_at > self._redis_fresh_s:
            return "redis has not answered recently"
        if self.missing_group:
            return f"the consumer group is missing on {self.missing_group}"
        return None


class Admin:
    """The endpoint of one worker: ``health`` always (the loops' hooks write it); the metrics' registry
    and the server only when ``admin_port`` is set."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.health = Health(config)
        self.enabled = config.admin_port is not None
        self.registry: CollectorRegistry | None = None
        self.address: tuple[str, int] | None = None  # where it listens, once serving
        self._depth = 0
        # Per shard (index -> count), replaced whole by the poller.
        self._waiting: Mapping[int, int] = {}
        self._pending: Mapping[int, int] = {}
        self._polled_at: float | None = None
        if self.enabled:
            from sluice.worker.observability.metrics import worker_registry

            self.registry = worker_registry()

    @contextlib.asynccontextmanager
    async def serving(self, worker: WorkerView) -> AsyncIterator[None]:
        """Serve while inside (nested: the outermost serves). Raises ``ConfigError`` when the port cannot
        be bound. Exceptions of the body come out as they were."""
        if not self.enabled or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.instruments(worker.telemetry)
        listener = await self._bind()
        log.info("admin endpoint listening", extra={"address": f"{self.address[0]}:{self.address[1]}"})  # type: ignore[index]
        self._depth = 1
        try:
            async with listener, anyio.create_task_group() as tg:
                tg.start_soon(serve, listener, self._app(worker))
                tg.start_soon(self._poll_loop, worker)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The loops never raise: the one exception is the body's, unwrapped for the caller.
            if len(group.exceptions) == 1:
                leaf = group.exceptions[0]
                raise leaf from leaf.__cause__
            raise
        finally:
            self._depth = 0

    # -- the loops (on the event loop) ------------------------------------------------------------------------

    async def _poll_loop(self, worker: WorkerView) -> None:
        while True:
            with contextlib.suppress(*_ERRORS):
                await self._poll(worker)
            await anyio.sleep(_POLL_S)

    async def _poll(self, worker: WorkerView) -> None:
        """One read of every shard's group figures; a failure keeps the last ones (and tells Health)."""
        waiting: dict[int, int] = {}
        pending: dict[int, int] = {}
        missing = ""
        group = self.config.group
        for shard in worker.keys.shards:
            try:
                groups = await worker.redis.xinfo_groups(shard.jobs)
            except ResponseError:  # no such key: the stream (and its group) is gone; Redis did answer
                groups = []
            except _ERRORS as exc:
                self.health.redis_failed(exc)
                return
            mine = next((g for g in groups if _text(g.get("name")) == group), None)
            if mine is None:
                # Seen missing: a joined worker creates it (or finds it, created since the read) before it
                # answers 503 for it, as its job reader does on NOGROUP.
                if not self.health.joined or not await self._ensure_group(worker, shard.jobs):
                    missing = missing or shard.jobs
                continue
            pending[shard.index] = int(mine.get("pending") or 0)
            if (lag := mine.get("lag")) is not None:  # None: Redis cannot tell (entries deleted mid-range)
                waiting[shard.index] = int(lag)
        self.health.redis_answered()
        self.health.missing_group = missing
        self._waiting, self._pending, self._polled_at = waiting, pending, self.health.clock()

    async def _ensure_group(self, worker: WorkerView, stream: str) -> bool:
        try:
            await ensure_group(worker.redis, stream, self.config.group)
        except _ERRORS:
            return False
        return True

    # -- metrics (callbacks run at a scrape) -----------------------------------------------------------------

    def instruments(self, telemetry: Telemetry) -> None:
        """Define the endpoint's own instruments (``ADMIN_METRICS``) on ``telemetry`` (at serving)."""

        def per_shard(figures: Callable[[], Mapping[int, int]]) -> Reading:
            return lambda: [(n, {"shard": str(i)}) for i, n in figures().items()]

        def age() -> list[tuple[float, Mapping[str, str]]]:
            at = self._polled_at
            return [] if at is None else [(self.health.clock() - at, {})]

        reads = {
            "sluice.jobs.waiting": per_shard(lambda: self._waiting),
            "sluice.jobs.pending": per_shard(lambda: self._pending),
            "sluice.jobs.figures_age": age,
        }
        for name, (kind, unit, description) in ADMIN_METRICS.items():
            if kind == "gauge":
                telemetry.observe(name, unit, description, reads[name], scope=_SCOPE)
            else:
                self.health._rtt = telemetry.histogram(name, unit, description, _RTT_BUCKETS, scope=_SCOPE)

    # -- the server (on the event loop: observability.admin_http) ---------------------------------------------

    async def _bind(self) -> Listener[SocketStream]:
        host, port = self.config.admin_host, self.config.admin_port
        assert port is not None
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            raise ConfigError(f"admin_port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        self.address = (host, listener.listeners[0].extra(SocketAttribute.local_port))
        return listener

    def _app(self, worker: WorkerView) -> WSGIApp:
        from prometheus_client import make_wsgi_app

        assert self.registry is not None
        metrics: WSGIApp = make_wsgi_app(self.registry)
        health, stopping = self.health, worker.stopping

        def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
            if method not in ("GET", "HEAD"):
                return _plain(start_response, "405 Method Not Allowed", "only GET and HEAD")
            if path == "/metrics":
                return metrics(environ, start_response)
            if path == "/healthz":
                reason = health.liveness()
            elif path == "/readyz":
                reason = health.readiness(stopping.is_set())
            else:
                return _plain(start_response, "404 Not Found", "not found: /healthz, /readyz, /metrics")
            if reason is None:
                return _plain(start_response, "200 OK", "ok")
            return _plain(start_response, "503 Service Unavailable", reason)

        return app


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _plain(start_response: StartResponse, status: str, text: str) -> list[bytes]:
    body = f"{text}\n".encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
        ],
    )
    return [body]

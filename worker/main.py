"""``sluice worker`` / ``python -m sluice.worker``: load the configuration, log what this worker serves,
wait for Redis, run one worker process until SIGTERM or SIGINT.

Rule: a start-up failure is one line on stderr and exit 2, never a traceback (the Redis URL always with
its password masked). Redis not answering is not a start-up failure: like Celery and arq workers, the
worker logs one line per attempt, naming the URL, and retries with back-off until Redis answers, unless
``--fail-fast`` (for supervisors that restart it themselves). A configuration without routes is refused:
such a worker would take every job off the shared stream and fail it as ``unknown route``.

Route-specific workers: every worker of a key prefix reads its one jobs stream, so all of them serve the
same route table; workers for other routes (or with another ``http_client``) form their own group under
their own ``key_prefix``, and producers enqueue under the prefix of the group that serves the route (README,
"Running workers"). One prefix with a jobs stream per route is the consumer loop's change to make.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator

import anyio
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.normalizer.redact import MIN_SECRET_LENGTH, is_placeholder
from sluice.schemas.errors import ConfigError, WorkerError
from sluice.worker.config import Config, check_admin_port, load_config
from sluice.worker.observability.logs import LOG_FORMATS, parse_level
from sluice.worker.redis.connect import QUIET, safe_url
from sluice.worker.redis.retry import BACKOFF_FIRST as _BACKOFF_FIRST
from sluice.worker.redis.retry import BACKOFF_MAX as _BACKOFF_MAX

__all__ = ["StartupError", "cmd_worker", "configure_worker", "log_banner", "main", "wait_for_redis"]

log = logging.getLogger("sluice.worker")
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class StartupError(Exception):
    """A one-line message for the operator; the worker exits 2."""


# -- start-up --------------------------------------------------------------------------------------------------------


def log_banner(config: Config, env: dict[str, str] | None = None) -> None:
    """What this worker is: where Redis is, its group and name, the routes it serves (a warning for each
    whose key variable is unset: its jobs would fail ``authentication``), and its limits."""
    env = dict(os.environ) if env is None else env
    log.info(
        "sluice worker starting",
        extra={
            "redis_url": safe_url(config.redis_url),
            "key_prefix": config.key_prefix,
            "group": config.group,
            "consumer": config.consumer_name,
            "http_client": config.http_client,
        },
    )
    for name, route in config.routes.items():
        log.info(
            f"route {name}",
            extra={"dialect": route.dialect, "model": route.model or "(the job's)", "base_url": route.base_url},
        )
        if route.api_key_env and not env.get(route.api_key_env):
            log.warning(
                f"route {name}: the key variable {route.api_key_env} is not set; its jobs will fail (authentication)"
            )
        elif (var := route.credentials_file_env) and not env.get(var):
            log.warning(
                f"route {name}: the service-account variable {var} is not set; its jobs will fail (authentication)"
            )
        elif route.api_key_env and is_placeholder(env[route.api_key_env]):
            log.warning(
                f"route {name}: the key in {route.api_key_env} is shorter than {MIN_SECRET_LENGTH} characters: "
                "taken as a placeholder (a keyless local server's dummy key) and not redacted"
            )
    t, lim = config.timeouts, config.limits
    log.info(
        "limits",
        extra={
            "max_in_flight": config.max_in_flight,
            "max_job_bytes": config.max_job_bytes,
            "retention_seconds": config.retention_seconds,
            "stream_maxlen": config.stream_maxlen,
            "timeouts": f"connect {t.connect:g}s, first_byte {t.first_byte:g}s, idle {t.idle:g}s, total {t.total:g}s",
            "max_line_bytes": lim.max_line_bytes,
            "max_event_bytes": lim.max_event_bytes,
            "max_total_bytes": lim.max_total_bytes,
        },
    )


def _check_redis_url(url: str) -> None:
    """Raises ``StartupError`` when redis-py cannot parse ``url`` (a wrong scheme, a port that is no number)."""
    from redis import connection

    parse: Callable[[str], object] = connection.parse_url  # what every redis-py client parses its URL with
    try:
        parse(url)
    except ValueError as exc:
        raise StartupError(f"bad Redis URL {safe_url(url)}: {exc}") from None


async def wait_for_redis(url: str, *, fail_fast: bool, socket_timeout: float = 5.0) -> None:
    """Return once Redis at ``url`` answers PING. Unreachable: one log line per attempt and a retry with
    back-off (0.5 s doubling to 30 s); with ``fail_fast``, ``StartupError`` at once. Refused credentials
    are a ``StartupError`` either way (waiting would not mend them)."""
    where = safe_url(url)
    try:
        redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=socket_timeout, socket_timeout=socket_timeout, **QUIET
        )
    except ValueError as exc:
        raise StartupError(f"bad Redis URL {where}: {exc}") from None
    delay, attempt = _BACKOFF_FIRST, 1
    try:
        while True:
            try:
                await redis.ping()
                return
            except AuthenticationError as exc:
                raise StartupError(f"Redis at {where} refused the credentials ({exc})") from None
            except _UNREACHABLE as exc:
                if fail_fast:
                    raise StartupError(f"Redis unreachable at {where} ({_reason(exc)})") from None
                log.warning(
                    f"Redis unreachable at {where} ({_reason(exc)}); retrying in {delay:g}s",
                    extra={"attempt": attempt, "redis_url": where},
                )
            await anyio.sleep(delay)
            delay, attempt = min(delay * 2, _BACKOFF_MAX), attempt + 1
    finally:
        await redis.aclose()


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


# -- the command ----------------------------------------------------------------------------------------------------


def _level(text: str) -> str:
    try:
        return parse_level(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _admin_port(text: str) -> int:
    try:
        port = int(text)
        check_admin_port("--admin-port", port)
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(
            exc.message if isinstance(exc, ConfigError) else f"not a port number: {text!r}"
        ) from None
    return port


def configure_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="TOML config file (default: $SLUICE_CONFIG)")
    p.add_argument("--redis-url", default=None, help="overrides $REDIS_URL and the config's redis_url")
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="redis_url names a node of a Redis Cluster (default: $SLUICE_REDIS_CLUSTER, else the config's)",
    )
    p.add_argument(
        "--log-level", default="INFO", type=_level, metavar="LEVEL", help="debug, info (default), warning, error"
    )
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="json lines, or key=value text; auto (default): text on a terminal, else json",
    )
    p.add_argument(
        "--admin-port",
        default=None,
        type=_admin_port,
        metavar="PORT",
        help="serve /healthz, /readyz and /metrics on this port (overrides the config's admin_port; default: off)",
    )
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="exit 2 at once when Redis does not answer (default: log and retry with back-off until it does)",
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from sluice.worker.observability.logs import setup_logging
    from sluice.worker.pipeline.consumer import Worker, install_signal_handlers

    try:
        config = load_config(args.config)
    except WorkerError as exc:
        raise StartupError(exc.message) from None
    if args.redis_url:
        config = msgspec.structs.replace(config, redis_url=args.redis_url)
    if getattr(args, "redis_cluster", None):
        config = msgspec.structs.replace(config, redis_cluster=True)
    if getattr(args, "admin_port", None) is not None:
        config = msgspec.structs.replace(config, admin_port=args.admin_port)
    if not config.routes:
        raise StartupError(
            f"{args.config or os.environ.get('SLUICE_CONFIG') or 'the configuration'} has no routes: a worker "
            "without routes would fail every job it takes (add a [routes.NAME] table)"
        )
    _check_redis_url(config.redis_url)  # before the banner: a worker that cannot start logs nothing first
    setup_logging(args.log_level, args.log_format)
    log_banner(config)

    async def go() -> None:
        worker = Worker(config)
        worker.retry_start = not args.fail_fast
        async with worker.admin.serving(worker):  # live (not ready) while Redis is awaited
            await wait_for_redis(config.redis_url, fail_fast=args.fail_fast)
            async with anyio.create_task_group() as tg:
                install_signal_handlers(worker, tg)
                await worker.run(ready=_settle_heap)
                tg.cancel_scope.cancel()

    try:
        anyio.run(go, backend_options={"use_uvloop": _has_uvloop()})
    except BaseException as exc:  # task groups wrap what their tasks raised: one line for the operator
        leaves = list(_leaves(exc))
        for leaf in leaves:
            if isinstance(leaf, StartupError):
                raise leaf from None
            if isinstance(leaf, ConfigError):  # e.g. routes that differ from the group's live workers
                raise StartupError(leaf.message) from None
        if leaves and all(isinstance(leaf, RedisError | OSError) for leaf in leaves):
            raise StartupError(f"Redis failed at {safe_url(config.redis_url)} ({_reason(leaves[0])})") from None
        raise
    return 0


def _settle_heap() -> None:
    """Once the worker has started: what start-up made (modules, configuration, clients, the telemetry SDK) lives as
    long as the process, so it goes to the collector's permanent generation (``gc.freeze``), after one collection
    of start-up's garbage. A full collection then traverses what the streams made, not the process's ~50,000
    long-lived objects: it took 40 ms of CPU at a time, about 5 % of a short benchmark run, landing in one run
    and not the next."""
    gc.collect()
    gc.freeze()


def _has_uvloop() -> bool:
    """The worker is event-loop bound when paced (many small reads): uvloop when installed (not on Windows)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.worker", description="run a sluice worker")
    configure_worker(p)
    args = p.parse_args(argv)
    try:
        return cmd_worker(args)
    except StartupError as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

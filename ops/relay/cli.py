"""``sluice relay``: serve the fan-out relay, or mint a signed token for one request.

Rule: secrets come from the environment or a file, never from the command line (where ``ps`` shows
them) and never appear in output except the token the operator asked for; each is at least 16 characters
(``RelayAuth``). Serving logs only structured records on stderr (JSON, or ``--log-format text``): a
``listening`` record with the URL once listening, an access record per request (``sluice.relay.access``),
and runs until SIGINT/SIGTERM, ending client streams cleanly first. A start-up failure (bad flags, an
unreadable secrets file, the port taken) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import anyio
from anyio.abc import TaskStatus

from sluice.schemas.errors import ConfigError
from sluice.worker.files import read_input
from sluice.worker.observability.logs import LOG_FORMATS, parse_level, setup_logging
from sluice.worker.redis.connect import env_flag

from .auth import RelayAuth
from .config import RelayConfig
from .limits import raise_fd_limit
from .origins import OriginPolicy
from .server import RunningRelay, serve_relay

__all__ = ["configure_parser", "run_from_args"]

SECRETS_ENV = "SLUICE_RELAY_SECRETS"


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port to listen on (default: 8090)")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--key-prefix", default=None, help="default: $SLUICE_KEY_PREFIX or sluice")
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="the Redis URL names a node of a Redis Cluster (default: $SLUICE_REDIS_CLUSTER)",
    )
    p.add_argument(
        "--secrets-file",
        default=None,
        help=f"deployment secrets, one per line, each at least 16 characters, the first signs tokens "
        f"(default: ${SECRETS_ENV}, comma-separated)",
    )
    p.add_argument("--heartbeat", type=float, default=15.0, help="seconds between heartbeats (default: 15)")
    p.add_argument("--buffer", type=int, default=1000, help="events a client may leave unread before it is cut off")
    p.add_argument("--max-clients", type=int, default=10_000, help="streams at once; past it 503 (default: 10000)")
    p.add_argument(
        "--write-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take no bytes before it is cut off (default: 10)",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (scheme://host[:port]) allowed besides the relay's own; repeat; '*' allows any",
    )
    p.add_argument("--session-ttl", type=int, default=3600, help="seconds a session cookie lasts (default: 3600)")
    p.add_argument(
        "--insecure-cookie",
        action="store_true",
        help="session cookies without Secure (plain-HTTP deployments other than localhost)",
    )
    p.add_argument("--redis-pool-size", type=int, default=8, help="connections for short commands (default: 8)")
    p.add_argument("--reader-lanes", type=int, default=2, help="shared XREAD readers, 2 connections each (default: 2)")
    p.add_argument(
        "--max-streams-per-socket",
        type=int,
        default=64,
        help="subscriptions one multiplexed WebSocket may hold (default: 64)",
    )
    p.add_argument("--log-level", default="INFO", type=_level, help="debug, info (default), warning, error")
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="json lines, or key=value text; auto (default): text on a terminal, else json",
    )
    p.add_argument("--mint", metavar="REQUEST_ID", default=None, help="print a signed token for REQUEST_ID and exit")
    p.add_argument("--ttl", type=int, default=3600, help="with --mint: seconds the token is valid (default: 3600)")
    p.add_argument("--allow-internal", action="store_true", help="with --mint: the token shows internal reasoning")


def _level(text: str) -> str:
    try:
        return parse_level(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _secrets(args: argparse.Namespace) -> tuple[str, ...]:
    if args.secrets_file:
        try:
            lines = read_input(args.secrets_file, "secrets file").decode().splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"secrets file {args.secrets_file} is not UTF-8 text") from None
    else:
        lines = os.environ.get(SECRETS_ENV, "").split(",")
    return tuple(s.strip() for s in lines if s.strip())


async def _stop_on_signal(running: RunningRelay, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()  # from here on a signal stops the relay cleanly
        async for signum in signals:
            logging.getLogger("sluice.relay").info("stopping", extra={"signal": signal.Signals(signum).name})
            running.stop()
            return


def run_from_args(args: argparse.Namespace) -> int:
    try:
        secrets = _secrets(args)
    except ValueError as exc:  # UnreadableFile, or not text
        print(f"sluice relay: {exc}", file=sys.stderr)
        return 2
    try:
        auth = RelayAuth(secrets)
    except ValueError as exc:
        print(f"sluice relay: {exc} (set ${SECRETS_ENV} or --secrets-file)", file=sys.stderr)
        return 2
    if args.mint:
        if args.ttl <= 0:
            print("sluice relay: --ttl must be positive", file=sys.stderr)
            return 2
        print(auth.sign(args.mint, int(time.time()) + args.ttl, allow_internal=args.allow_internal))
        return 0
    if args.buffer < 1 or args.heartbeat <= 0:
        print("sluice relay: --buffer must be >= 1 and --heartbeat > 0", file=sys.stderr)
        return 2
    counts = (args.max_clients, args.redis_pool_size, args.reader_lanes, args.session_ttl, args.max_streams_per_socket)
    if min(counts) < 1 or args.write_timeout <= 0:
        print(
            "sluice relay: --max-clients, --redis-pool-size, --reader-lanes, --session-ttl and "
            "--max-streams-per-socket must be >= 1, --write-timeout > 0",
            file=sys.stderr,
        )
        return 2
    try:
        OriginPolicy(args.allowed_origin)
    except ValueError as exc:
        print(f"sluice relay: --allowed-origin: {exc}", file=sys.stderr)
        return 2
    try:
        env = os.environ.get("SLUICE_REDIS_CLUSTER", "0")
        cluster = bool(args.redis_cluster) or env_flag("SLUICE_REDIS_CLUSTER", env)
    except ConfigError as exc:
        print(f"sluice relay: {exc.message}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    log = logging.getLogger("sluice.relay")
    # Each client is a descriptor: the usual soft limit of 1,024 would refuse connections long before
    # --max-clients (and make accept() fail in a loop). Logged once listening: a relay that cannot listen
    # says only why.
    fds = raise_fd_limit()
    config = RelayConfig(
        redis_url=args.redis_url or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0",
        key_prefix=args.key_prefix or os.environ.get("SLUICE_KEY_PREFIX") or "sluice",
        secrets=secrets,
        heartbeat=args.heartbeat,
        buffer=args.buffer,
        max_clients=args.max_clients,
        write_timeout=args.write_timeout,
        allowed_origins=tuple(args.allowed_origin),
        session_ttl=args.session_ttl,
        cookie_secure=not args.insecure_cookie,
        redis_pool_size=args.redis_pool_size,
        reader_lanes=args.reader_lanes,
        max_streams_per_socket=args.max_streams_per_socket,
        redis_cluster=cluster,
    )

    async def serve() -> None:
        async with serve_relay(config, args.host, args.port) as running, anyio.create_task_group() as tg:
            await tg.start(_stop_on_signal, running)  # before saying it listens: a SIGTERM then is handled
            log.info(f"listening on {running.url}", extra={"url": running.url})
            if fds is not None:
                log.info(
                    "file descriptor limit", extra={"soft": fds.soft, "hard": fds.hard, "raised_from": fds.raised_from}
                )
                if fds.soft < args.max_clients + 64:
                    log.warning(
                        "the file descriptor limit is below --max-clients: clients past it will be refused by accept()",
                        extra={"soft": fds.soft, "max_clients": args.max_clients},
                    )
            await running.wait_stopped()
            tg.cancel_scope.cancel()

    failed: list[OSError] = []
    try:
        anyio.run(serve)
    except* OSError as group:  # task groups wrap it: one line, not the group's traceback
        failed += [e for e in _leaves(group) if isinstance(e, OSError)]
    if failed:
        print(f"sluice relay: {failed[0].strerror or failed[0]}", file=sys.stderr)
        return 2
    return 0


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]

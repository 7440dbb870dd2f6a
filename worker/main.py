"""``sluice worker`` / ``python -m sluice.worker``: load the configuration, set up logging, run one worker
process until SIGTERM or SIGINT.

Rule: a start-up failure is one line on stderr (the Redis URL with its password masked) and exit 2, never
a traceback.
"""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit, urlunsplit

import anyio
import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.schemas.errors import WorkerError
from sluice.worker.config import load_config

__all__ = ["StartupError", "cmd_worker", "configure_worker", "main", "safe_url"]


class StartupError(Exception):
    """A one-line message for the operator; the worker exits 2."""


def safe_url(url: str) -> str:
    """The URL with its password masked (it is printed in errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparsable URL)"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# -- the command ----------------------------------------------------------------------------------------------------


def configure_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="TOML config file (default: $SLUICE_CONFIG)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING, ERROR")
    p.add_argument(
        "--redis-cluster", action="store_true", default=None,
        help="redis_url names a node of a Redis Cluster (default: $SLUICE_REDIS_CLUSTER, else the config's)",
    )  # fmt: skip


def cmd_worker(args: argparse.Namespace) -> int:
    from sluice.worker.consumer import Worker, install_signal_handlers
    from sluice.worker.logs import setup_logging

    try:
        config = load_config(args.config)
    except WorkerError as exc:
        raise StartupError(exc.message) from None
    if getattr(args, "redis_cluster", None):
        config = msgspec.structs.replace(config, redis_cluster=True)
    if not config.routes:
        print("sluice worker: warning: the configuration has no routes; every job will fail", file=sys.stderr)
    setup_logging(args.log_level)

    async def go() -> None:
        worker = Worker(config)
        async with anyio.create_task_group() as tg:
            install_signal_handlers(worker, tg)
            await worker.run()
            tg.cancel_scope.cancel()

    try:
        anyio.run(go, backend_options={"use_uvloop": _has_uvloop()})
    except (RedisConnectionError, OSError) as exc:
        raise StartupError(f"Redis unreachable at {safe_url(config.redis_url)} ({exc})") from None
    return 0


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

"""The Redis-facing operator commands: enqueue, status, cancel, tail.

Rule: each command prints one clear line on stderr and exits 2 on bad input: an unknown request, Redis
unreachable (naming the URL it tried, password masked), a bad or unreadable job file (naming the field at
fault). A command that waits on or reports a request exits by its state, the one table of
``sluice.cli.exits``: 0 completed, 3 failed, 4 interrupted, 5 not finished. A request left queued is said so
at once, and again after ``--warn-after`` seconds with whether a live worker of the key prefix serves its
route (the workers' registry, ``sluice.worker.pipeline.membership``): the usual cause is a wrong prefix or Redis.
Where Redis is found: ``--redis-url``, else ``$REDIS_URL``, else the config file's
(``--config`` or ``$SLUICE_CONFIG``), else ``redis://127.0.0.1:6379/0``; the key prefix likewise; a Redis
Cluster with ``--redis-cluster``, ``$SLUICE_REDIS_CLUSTER=1`` or the config's ``redis_cluster``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.cli.exits import Exit, for_state
from sluice.client import (
    InvalidJob,
    RedisCommandError,
    RedisUnavailable,
    SluiceClient,
    Status,
    UnknownRequest,
)
from sluice.schemas.errors import WorkerError
from sluice.schemas.jobs import Job, decode_job
from sluice.schemas.keys import Position
from sluice.schemas.replies import read_entries
from sluice.worker.config import Config, load_config
from sluice.worker.files import read_input
from sluice.worker.redis.connect import connect, safe_url

__all__ = [
    "CommandError",
    "cmd_cancel",
    "cmd_enqueue",
    "cmd_status",
    "cmd_tail",
    "config_from_args",
    "configure_cancel",
    "configure_enqueue",
    "configure_status",
    "configure_tail",
    "redis_args",
    "run_with_client",
]

_ENC = msgspec.json.Encoder()
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_CONNECT_TIMEOUT = 5.0
_RAW_BLOCK_MS = 500


class CommandError(Exception):
    """A one-line message for the operator; the command exits 2."""


# -- Redis and configuration ---------------------------------------------------------------------------------


def redis_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Redis")
    g.add_argument(
        "--redis-url", default=None, help="default: $REDIS_URL, else the config's, else redis://127.0.0.1:6379/0"
    )
    g.add_argument("--key-prefix", default=None, help="default: $SLUICE_KEY_PREFIX, else the config's, else sluice")
    g.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="the URL names a node of a Redis Cluster (default: $SLUICE_REDIS_CLUSTER, else the config's)",
    )
    g.add_argument("--config", "-c", default=None, help="the worker's TOML config (default: $SLUICE_CONFIG)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The configuration these arguments point at, with ``--redis-url`` / ``--key-prefix`` applied."""
    try:
        config = load_config(getattr(args, "config", None))
    except WorkerError as exc:
        raise CommandError(exc.message) from None
    overrides: dict[str, str | bool] = {}
    if getattr(args, "redis_url", None):
        overrides["redis_url"] = args.redis_url
    if getattr(args, "key_prefix", None):
        overrides["key_prefix"] = args.key_prefix
    if getattr(args, "redis_cluster", None):
        overrides["redis_cluster"] = True
    return msgspec.structs.replace(config, **overrides) if overrides else config


def open_client(args: argparse.Namespace) -> tuple[SluiceClient, str]:
    config = config_from_args(args)
    url = config.redis_url
    try:
        redis = connect(url, cluster=config.redis_cluster, socket_connect_timeout=_CONNECT_TIMEOUT)
    except ValueError as exc:
        raise CommandError(f"bad Redis URL {safe_url(url)}: {exc}") from None
    shards = config.job_shards if config.job_shards > 1 else None  # None: the layout the workers recorded
    client = SluiceClient(
        redis, key_prefix=config.key_prefix, retention_seconds=config.retention_seconds, job_shards=shards
    )
    return client, url


def run_with_client(args: argparse.Namespace, fn: Callable[[SluiceClient], Awaitable[int]]) -> int:
    """Run ``fn`` with a client on a fresh event loop; Redis failures become one-line errors."""
    client, url = open_client(args)
    where = safe_url(url)

    async def go() -> int:
        try:
            return int(await fn(client))
        except BrokenPipeError:
            raise  # the reader of our output went away: not Redis's fault
        except (RedisUnavailable, RedisCommandError, InvalidJob) as exc:
            raise CommandError(str(exc)) from None
        except UnknownRequest:
            raise CommandError(
                f"unknown request {getattr(args, 'request_id', '')} (no status record; keys expire after the "
                "retention time)"
            ) from None
        except AuthenticationError as exc:
            raise CommandError(f"Redis at {where} refused the credentials ({exc})") from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise CommandError(f"Redis unreachable at {where} ({exc})") from None
        except ResponseError as exc:
            raise CommandError(f"Redis at {where} answered: {exc}") from None
        except RedisError as exc:
            raise CommandError(f"Redis error at {where}: {exc}") from None
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()

    return anyio.run(go)


async def _require(c: SluiceClient, request_id: str) -> Status:
    try:
        return await c.status(request_id)
    except UnknownRequest:
        raise CommandError(
            f"unknown request {request_id} (no status record; keys expire after the retention time)"
        ) from None


# -- enqueue ---------------------------------------------------------------------------------------------------


def _view_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="print contract events as JSON lines")
    g.add_argument("--plain", action="store_true", help="plain text even on a terminal (the default when piped)")


def _view_mode(args: argparse.Namespace) -> str:
    return "json" if args.json else ("plain" if args.plain else "auto")


def configure_enqueue(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_file", nargs="?", help="a JSON job file, or - for standard input")
    p.add_argument("--route", help="the configured route to use (overrides the file's)")
    p.add_argument("--prompt", help="the user message (builds a one-message job without a file)")
    p.add_argument("--system", help="a system prompt (with --prompt)")
    p.add_argument("--model", help="a model other than the route's default (overrides the file's)")
    p.add_argument("--max-tokens", type=int, help="with --prompt: max_tokens")
    p.add_argument("--request-id", help="the request id (default: the file's, else generated)")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE", help="echoed in the status")
    p.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="then show the answer live until it ends; exits 0 completed, 3 failed, 4 interrupted",
    )
    _warn_arg(p)
    _view_args(p)
    redis_args(p)


def _warn_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--warn-after",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="a request still queued after this long: say whether a live worker serves its route (default 5)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, not {text!r}")
    return value


def _load_job(args: argparse.Namespace) -> Job:
    """The job from the file or the flags. Raises ``CommandError`` naming the file and the field at fault."""
    meta: dict[str, str] = {}
    for item in args.metadata:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CommandError(f"--metadata {item!r}: expected KEY=VALUE")
        meta[key] = value
    if args.job_file:
        if args.prompt or args.system or args.max_tokens:
            raise CommandError("give a job file or --prompt, not both")
        if args.job_file == "-":
            data, name = sys.stdin.buffer.read(), "standard input"
        else:
            data, name = read_input(args.job_file, "job file"), args.job_file
        doc: Any = data
    else:
        if not args.route or not args.prompt:
            raise CommandError("give a job file, or --route and --prompt")
        request: dict[str, Any] = {"messages": [{"role": "user", "content": args.prompt}]}
        if args.system:
            request["system"] = args.system
        if args.max_tokens is not None:
            request["max_tokens"] = args.max_tokens
        doc, name = {"route": args.route, "request": request}, "the job"
    try:
        job = decode_job(doc if isinstance(doc, bytes) else msgspec.json.encode(doc))
    except WorkerError as exc:
        raise CommandError(f"{name}: {exc.message}") from None
    overrides: dict[str, Any] = {}
    for flag in ("route", "model", "request_id"):
        if getattr(args, flag):
            overrides[flag] = getattr(args, flag)
    if meta:
        overrides["metadata"] = {**job.metadata, **meta}
    if overrides:
        try:  # re-checked like a file: an override must be as valid as the job itself
            job = decode_job(msgspec.json.encode(msgspec.structs.replace(job, **overrides)))
        except WorkerError as exc:
            raise CommandError(f"{name}: {exc.message}") from None
    return job


def cmd_enqueue(args: argparse.Namespace) -> int:
    job = _load_job(args)

    async def go(c: SluiceClient) -> int:
        known = job.request_id is not None and bool(await c.status_record(job.request_id))
        rid = await c.enqueue(job)
        print(rid, flush=True)
        if known:
            print(f"sluice enqueue: request {rid} is known already: it runs once, not enqueued again", file=sys.stderr)
        if not args.follow:
            return Exit.OK
        return await _follow_to_the_end(c, args, rid, "0-0", "enqueue")

    return run_with_client(args, go)


# -- status / cancel ---------------------------------------------------------------------------------------------


def configure_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", help="the request id enqueue printed")
    redis_args(p)


def cmd_status(args: argparse.Namespace) -> int:
    async def go(c: SluiceClient) -> int:
        st = await _require(c, args.request_id)
        record = await c.status_record(args.request_id)  # every field stored, typed as Status reads them
        doc = _typed_record(record, st)
        if st.state == "queued" and record.get("waiting_route"):
            from sluice.cli.routes import live_route  # a parked job: its route's state now, beside the record

            doc["waiting_route_now"] = await live_route(c, record["waiting_route"])
        sys.stdout.buffer.write(msgspec.json.format(_ENC.encode(doc)) + b"\n")
        sys.stdout.flush()
        return for_state(st.state)

    return run_with_client(args, go)


def _typed_record(record: dict[str, str], st: Status) -> dict[str, object]:
    """The stored fields, sorted, each as ``Status`` types it (numbers, flags, the JSON fields as objects);
    a field ``Status`` does not name (``published``, ``replicas_acked``, a later version's) is a number when
    it is one, else its text."""
    typed = msgspec.to_builtins(st)
    out: dict[str, object] = {}
    for key, value in sorted(record.items()):
        if key in typed and value != "":
            out[key] = typed[key]
        else:
            out[key] = int(value) if _INTEGER.fullmatch(value) else value
    return out


def configure_cancel(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", help="the request to cancel")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the terminal status, then exit by it: 4 interrupted (a cancel that took effect), 0 completed "
        "first, 5 none within --timeout",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="with --wait: seconds (default 30)")
    redis_args(p)


def cmd_cancel(args: argparse.Namespace) -> int:
    async def go(c: SluiceClient) -> int:
        st = await _require(c, args.request_id)
        if st.terminal or not await c.cancel(args.request_id):
            st = await c.status(args.request_id)
            print(f"request {args.request_id} already finished ({st.state}): nothing to cancel")
            return 0
        print(f"cancel requested for {args.request_id} (was {st.state})", flush=True)
        if not args.wait:
            return Exit.OK
        with anyio.move_on_after(args.timeout) as scope:
            while not (st := await c.status(args.request_id)).terminal:  # noqa: ASYNC110
                await anyio.sleep(0.05)  # polling Redis: nothing in this process can be awaited
        if scope.cancelled_caught:
            print(
                f"sluice cancel: request {args.request_id} has no terminal status after {args.timeout:g}s",
                file=sys.stderr,
            )
            return Exit.NOT_FINISHED
        reason = f" / {st.error.category}" if st.error else ""
        print(f"request {args.request_id} ended {st.state}{reason}")
        return for_state(st.state)

    return run_with_client(args, go)


# -- tail ----------------------------------------------------------------------------------------------------------


def configure_tail(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", help="the request to follow")
    p.add_argument("--after", default="0-0", help="resume after this position (<attempt>-<seq>, e.g. 1-5)")
    p.add_argument("--raw", action="store_true", help="the raw provider events (JSON lines) instead")
    _warn_arg(p)
    _view_args(p)
    redis_args(p)


async def _events(c: SluiceClient, request_id: str, after: str) -> AsyncIterator[Any]:
    try:
        async for ev in c.events(request_id, after):
            yield ev
    except UnknownRequest:
        raise CommandError(f"unknown request {request_id}") from None


async def follow(c: SluiceClient, request_id: str, after: str, mode: str) -> None:
    from sluice.cli.tail_view import feed_all, make_view

    await feed_all(_events(c, request_id, after), make_view(mode))


def _raw_doc(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, object]:
    doc: dict[str, object] = {"position": entry_id.decode()}
    for k, v in fields.items():
        key, text = k.decode(), v.decode("utf-8", "replace")
        doc[key] = int(text) if key in ("offset", "ts") and text.isdigit() else text
    return doc


async def follow_raw(c: SluiceClient, request_id: str, after: str) -> None:
    """Print raw entries as JSON lines, live, until the request is finished and all are printed.
    The terminal status is stored after the last append, so one read after seeing it is complete."""
    key = c.keys.request(request_id).raw
    pos = after
    out = sys.stdout.buffer
    finished = False
    while True:
        entries = read_entries(await c.redis.xread({key: pos}, count=500, block=None if finished else _RAW_BLOCK_MS))
        for entry_id, fields in entries:
            pos = entry_id.decode()
            out.write(_ENC.encode(_raw_doc(entry_id, fields)) + b"\n")
        if entries:
            out.flush()
        if finished:
            return
        if not entries:
            finished = (await _require(c, request_id)).terminal


def cmd_tail(args: argparse.Namespace) -> int:
    if not _valid_position(args.after):
        raise CommandError(f"--after {args.after!r}: expected a position <attempt>-<seq>, e.g. 1-5")

    if args.raw and args.plain:
        raise CommandError("--raw prints JSON lines; --plain does not apply")

    async def go(c: SluiceClient) -> int:
        return await _follow_to_the_end(c, args, args.request_id, args.after, "tail")

    return run_with_client(args, go)


async def _follow_to_the_end(c: SluiceClient, args: argparse.Namespace, rid: str, after: str, command: str) -> int:
    """Show the request until it ends (raw entries with ``--raw``); the exit status is its final state. While
    it stays queued, says so, then after ``--warn-after`` seconds whether any live worker serves it."""
    st = await _require(c, rid)
    async with anyio.create_task_group() as tg:
        if st.state == "queued":
            print(
                f"sluice {command}: request {rid} is queued: waiting for a worker to pick it up",
                file=sys.stderr,
                flush=True,
            )
            tg.start_soon(_warn_if_unserved, c, args, rid, command)
        if getattr(args, "raw", False):
            await follow_raw(c, rid, after)
        else:
            await follow(c, rid, after, _view_mode(args))
        tg.cancel_scope.cancel()
    return for_state((await c.status(rid)).state)


async def _warn_if_unserved(c: SluiceClient, args: argparse.Namespace, rid: str, command: str) -> None:
    from sluice.worker.pipeline.membership import live_members

    await anyio.sleep(args.warn_after)
    st = await c.status(rid)
    if st.state != "queued":
        return
    config = config_from_args(args)  # the live window follows its heartbeat_ms / claim_idle_ms
    members = await live_members(c.redis, c.keys, config)
    serving = sorted(name for name, m in members.items() if st.route in m.routes)
    where = f"key prefix {c.keys.prefix!r} at {safe_url(config.redis_url)}"
    if serving:
        line = (
            f"request {rid} is still queued after {args.warn_after:g}s: {len(serving)} live worker(s) of {where} "
            f"serve route {st.route!r} ({', '.join(serving[:3])}{', ...' if len(serving) > 3 else ''}); all busy"
        )
    elif members:
        routes = sorted({r for m in members.values() for r in m.routes})
        line = (
            f"no live worker of {where} serves route {st.route!r} (they serve {', '.join(routes) or 'none'}): "
            "start one that does, or enqueue under the prefix of the workers that serve it"
        )
    else:
        line = (
            f"no live worker of {where} serves route {st.route!r} (none is registered): the request waits "
            "until one starts; check --key-prefix / --redis-url against the workers' configuration"
        )
    print(f"sluice {command}: {line}", file=sys.stderr, flush=True)


def _valid_position(pos: str) -> bool:
    try:
        Position.from_entry_id(pos)
    except ValueError:
        return False
    return True

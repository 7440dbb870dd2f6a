"""``sluice worker`` and the Redis-facing operator commands (enqueue, status, cancel, tail, dlq).

Rule: each command prints one clear line and exits non-zero on bad input (unknown request, Redis
unreachable with the URL it tried, a bad job file with the field at fault).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from ops.client import SluiceClient
from schemas.errors import WorkerError
from schemas.events import encode_event
from schemas.jobs import Job, decode_job
from worker.config import load_config
from worker.consumer import Worker, install_signal_handlers
from worker.logs import setup_logging

__all__ = ["cmd_cancel", "cmd_enqueue", "cmd_status", "cmd_tail", "cmd_worker", "redis_args"]

_ENC = msgspec.json.Encoder()


class CommandError(Exception):
    pass


def redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--key-prefix", default=None, help="default: $SLUICE_KEY_PREFIX or sluice")


def _client(args: argparse.Namespace) -> tuple[SluiceClient, str]:
    url = args.redis_url or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    prefix = args.key_prefix or os.environ.get("SLUICE_KEY_PREFIX") or "sluice"
    return SluiceClient(aioredis.Redis.from_url(url), key_prefix=prefix), url


def _run(args: argparse.Namespace, fn: Callable[[SluiceClient], Awaitable[int]]) -> int:
    client, url = _client(args)

    async def go() -> int:
        try:
            return int(await fn(client))
        except (RedisConnectionError, OSError) as exc:
            raise CommandError(f"Redis unreachable at {url} ({type(exc).__name__})") from None
        finally:
            await client.aclose()

    return anyio.run(go)


def cmd_worker(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except WorkerError as exc:
        raise CommandError(exc.message) from None
    setup_logging(args.log_level)

    async def go() -> None:
        worker = Worker(config)
        async with anyio.create_task_group() as tg:
            install_signal_handlers(worker, tg)
            await worker.run()
            tg.cancel_scope.cancel()

    anyio.run(go)
    return 0


def _load_job(args: argparse.Namespace) -> Job:
    if args.job_file:
        p = Path(args.job_file)
        data = sys.stdin.buffer.read() if args.job_file == "-" else (p.read_bytes() if p.is_file() else None)
        if data is None:
            raise CommandError(f"no such job file: {args.job_file}")
        try:
            return decode_job(data)
        except WorkerError as exc:
            raise CommandError(f"{args.job_file}: {exc.message}") from None
    if not args.route or not args.prompt:
        raise CommandError("give a job file, or --route and --prompt")
    doc = {"route": args.route, "request": {"messages": [{"role": "user", "content": args.prompt}]}}
    if args.model:
        doc["model"] = args.model
    if args.request_id:
        doc["request_id"] = args.request_id
    try:
        return decode_job(msgspec.json.encode(doc))
    except WorkerError as exc:
        raise CommandError(exc.message) from None


def cmd_enqueue(args: argparse.Namespace) -> int:
    job = _load_job(args)

    async def go(c: SluiceClient) -> int:
        rid = await c.enqueue(job)
        print(rid)
        if args.follow:
            async for ev in c.events(rid):
                sys.stdout.buffer.write(encode_event(ev) + b"\n")
                sys.stdout.flush()
        return 0

    return _run(args, go)


def cmd_status(args: argparse.Namespace) -> int:
    async def go(c: SluiceClient) -> int:
        st = await c.status(args.request_id)
        if not st:
            raise CommandError(f"unknown request {args.request_id}")
        sys.stdout.buffer.write(msgspec.json.format(_ENC.encode(st)) + b"\n")
        return 0

    return _run(args, go)


def cmd_cancel(args: argparse.Namespace) -> int:
    async def go(c: SluiceClient) -> int:
        if not await c.cancel(args.request_id):
            raise CommandError(f"unknown request {args.request_id}")
        print(f"cancel requested for {args.request_id}")
        return 0

    return _run(args, go)


def cmd_tail(args: argparse.Namespace) -> int:
    async def go(c: SluiceClient) -> int:
        if not await c.status(args.request_id):
            raise CommandError(f"unknown request {args.request_id}")
        if args.raw:
            keys = c.keys.request(args.request_id)
            for entry_id, fields in await c.redis.xrange(keys.raw):
                doc = {
                    "position": entry_id.decode(),
                    **{k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()},
                }
                sys.stdout.buffer.write(_ENC.encode(doc) + b"\n")
            return 0
        async for ev in c.events(args.request_id, args.after):
            sys.stdout.buffer.write(encode_event(ev) + b"\n")
            sys.stdout.flush()
        return 0

    return _run(args, go)

"""Redis for the benchmark: find or start a server, measure the XADD ceilings, and throttle a connection.

Rule: the ceilings are what one Python process can push into Redis with nothing else to do, measured in
the same run as the worker they are compared with: redis-py (asyncio, hiredis) pipelining pre-encoded
events round-robin over N streams, and the same commands packed by hiredis and written to a plain asyncio
socket. The throttling proxy only delays and rate-limits bytes (Redis answering slowly); it
never drops or reorders them. Everything here talks to loopback addresses only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hiredis
import redis.asyncio as aioredis

from sluice.harness.embedded_redis import RedisUnavailable, answers, embedded_redis, redis_server_binary

__all__ = [
    "Ceiling",
    "ThrottleProxy",
    "find_or_start_redis",
    "throttled",
    "xadd_ceiling_redispy",
    "xadd_ceiling_resp",
]

# hiredis' stub types the argument as a 1-tuple; the alias costs no call per command (a cast() would)
_pack: Callable[[tuple[bytes | str | int, ...]], bytes] = hiredis.pack_command  # type: ignore[assignment]


@contextlib.contextmanager
def find_or_start_redis(url: str | None = None) -> Iterator[tuple[str, str]]:
    """Yields (url, origin): ``url`` if given, else ``$REDIS_URL``, else 127.0.0.1:6379 if it answers, else
    a private ``redis-server`` on a free port (``sluice.harness.embedded_redis``, stopped on exit). Raises
    ``RuntimeError`` if none."""
    if url or (url := os.environ.get("REDIS_URL")):
        yield url, "given"
        return
    if answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0", "local:6379"
        return
    try:
        binary = redis_server_binary()
    except RedisUnavailable:
        raise RuntimeError(
            "no Redis: pass --redis-url, set REDIS_URL, run one on 127.0.0.1:6379 or install redis"
        ) from None
    with embedded_redis(binary=binary) as server:
        yield server.url, f"started:{binary}"


# -- ceilings ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Ceiling:
    method: str
    streams: int
    commands: int
    payload_bytes: int
    pipeline: int
    wall_s: float
    cpu_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "streams": self.streams,
            "commands": self.commands,
            "payload_bytes": self.payload_bytes,
            "pipeline": self.pipeline,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "xadd_per_s": self.commands / self.wall_s if self.wall_s else 0.0,
            "client_cpu_us_per_xadd": self.cpu_s / self.commands * 1e6 if self.commands else 0.0,
        }


def _keys(prefix: str, streams: int) -> list[str]:
    return [f"{prefix}:ceiling:{{s{i}}}" for i in range(streams)]


async def _delete(r: aioredis.Redis, keys: list[str]) -> None:
    for i in range(0, len(keys), 500):
        await r.delete(*keys[i : i + 500])


async def xadd_ceiling_redispy(
    url: str, prefix: str, *, streams: int = 1000, commands: int = 100_000, payload: bytes, pipeline: int = 1000
) -> Ceiling:
    """redis-py asyncio pipelines (no transaction) of ``XADD key * type block.delta event <payload>``,
    round-robin over ``streams`` keys: the ceiling of bare, pre-encoded events from one process."""
    r = aioredis.Redis.from_url(url)
    keys = _keys(prefix, streams)
    try:
        await r.ping()
        c0, w0 = time.process_time(), time.perf_counter()
        sent = 0
        while sent < commands:
            n = min(pipeline, commands - sent)
            pipe = r.pipeline(transaction=False)
            for i in range(sent, sent + n):
                pipe.xadd(keys[i % streams], {"type": "block.delta", "event": payload})
            await pipe.execute()
            sent += n
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        await _delete(r, keys)
    finally:
        await r.aclose()
    return Ceiling("redis-py asyncio pipeline", streams, commands, len(payload), pipeline, wall, cpu)


def _split_url(url: str) -> tuple[str, int, int]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    db = int(u.path.lstrip("/") or 0)
    return u.hostname or "127.0.0.1", u.port or 6379, db


async def xadd_ceiling_resp(
    url: str, prefix: str, *, streams: int = 1000, commands: int = 100_000, payload: bytes, pipeline: int = 1000
) -> Ceiling:
    """The same XADDs as ``xadd_ceiling_redispy``, packed and parsed by hiredis on a plain asyncio socket
    (what the worker's append pipe does): what the client library costs, by difference."""
    host, port, db = _split_url(url)
    reader, writer = await asyncio.open_connection(host, port)
    keys = [k.encode() for k in _keys(prefix, streams)]
    parser = hiredis.Reader()
    try:
        if db:
            writer.write(_pack(("SELECT", db)))
            await _read_replies(reader, parser, 1)
        c0, w0 = time.process_time(), time.perf_counter()
        sent = 0
        while sent < commands:
            n = min(pipeline, commands - sent)
            writer.write(
                b"".join(
                    _pack((b"XADD", keys[i % streams], b"*", b"type", b"block.delta", b"event", payload))
                    for i in range(sent, sent + n)
                )
            )
            await writer.drain()
            await _read_replies(reader, parser, n)
            sent += n
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    r = aioredis.Redis.from_url(url)
    try:
        await _delete(r, [k.decode() for k in keys])
    finally:
        await r.aclose()
    return Ceiling("hiredis-packed RESP, asyncio socket", streams, commands, len(payload), pipeline, wall, cpu)


async def _read_replies(reader: asyncio.StreamReader, parser: hiredis.Reader, n: int) -> None:
    """Wait for ``n`` replies; an error reply (``-ERR ...``) is fatal."""
    while n:
        reply = parser.gets()
        if reply is False:
            if not (data := await reader.read(65536)):
                raise RuntimeError("Redis closed the connection")
            parser.feed(data)
        elif isinstance(reply, hiredis.ReplyError):
            raise RuntimeError(f"Redis refused a ceiling command: {str(reply)[:200]}")
        else:
            n -= 1


# -- a throttling proxy -------------------------------------------------------------------------------------


class ThrottleProxy:
    """A loopback TCP proxy in front of Redis: every reply is held ``delay_ms`` and the commands sent to it
    are capped at ``bytes_per_s`` (0: no cap), pushing back through TCP. A slow Redis as the worker sees
    it: slow to answer and slow to take writes."""

    def __init__(
        self, target_host: str, target_port: int, *, delay_ms: float, bytes_per_s: int = 0, db: int = 0
    ) -> None:
        self.target = (target_host, target_port)
        self.db = db
        self.delay = delay_ms / 1000
        self.bytes_per_s = bytes_per_s
        self.port = 0
        self.connections = 0
        self.bytes_down = 0
        self.bytes_up = 0
        self._rate_free_at = 0.0  # loop time when the capped direction may send again
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        # Abort the sockets rather than cancel the handlers: each handler then ends normally (asyncio's
        # start_server callback mishandles a cancelled handler task on Python 3.11).
        if self._server is not None:
            self._server.close()
        for writers in self._conns.values():
            for w in writers:
                w.transport.abort()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections += 1
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        self._conns[task] = [cw, sw]
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._pump(cr, sw, delay=0.0, rate=self.bytes_per_s))  # commands: rate-capped
                tg.create_task(self._pump(sr, cw, delay=self.delay, rate=0))  # replies: delayed
        except* (ConnectionError, OSError):
            pass
        finally:
            for w in (cw, sw):
                w.close()
            self._conns.pop(task, None)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, *, delay: float, rate: int) -> None:
        """Forward r -> w in order, each piece held ``delay`` seconds after it arrived and the flow of every
        capped pump together held to ``rate`` bytes/s. The queue between is bounded, so a capped direction
        pushes back on its sender through TCP instead of buffering here."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=16)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if rate:
                    # One budget for all connections (the worker opens many): the cap is Redis', not a socket's.
                    now = loop.time()
                    start = max(now, self._rate_free_at)
                    self._rate_free_at = start + len(data) / rate
                    await asyncio.sleep(self._rate_free_at - now)
                w.write(data)
                await w.drain()
            w.close()

        async def receive() -> None:
            try:
                while data := await r.read(16384):
                    if delay:
                        self.bytes_down += len(data)
                    else:
                        self.bytes_up += len(data)
                    await queue.put((loop.time() + delay, data))
            finally:
                await queue.put(None)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(deliver())
            tg.create_task(receive())


@contextlib.asynccontextmanager
async def throttled(url: str, *, delay_ms: float, bytes_per_s: int = 0) -> AsyncIterator[ThrottleProxy]:
    host, port, db = _split_url(url)
    proxy = ThrottleProxy(host, port, delay_ms=delay_ms, bytes_per_s=bytes_per_s, db=db)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.aclose()

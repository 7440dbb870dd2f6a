"""One dedicated Redis connection for the worker's appends: hand-packed RESP, pipelined across streams.

Rule: every call queued during one event-loop tick goes out in one ``write`` (no timer: an idle worker
sends each call at once, a busy one many per write); replies are parsed in C by hiredis and answered in
order. A connection failure, or a reply later than ``socket_timeout``, fails every call in flight with
redis-py's ``ConnectionError`` (callers retry: appends are idempotent) and the next call reconnects.
Error replies raise ``ResponseError`` for their own call only.

Why not redis-py's pipeline: per call it packs arguments in Python, takes a pooled connection and awaits
each reply under its own timeout; that was a fifth of the worker's CPU per paced event. Connections
redis-py makes that this does not (TLS, Sentinel, Cluster) keep using redis-py (``make_append_pipe``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["RedisPipe", "direct_pipe_possible"]


def direct_pipe_possible(redis: aioredis.Redis) -> bool:
    """Plain TCP or a Unix socket: what this pipe connects to by itself."""
    return redis.connection_pool.connection_class in (Connection, UnixDomainSocketConnection)


class _Proto(asyncio.Protocol):
    def __init__(self, pipe: RedisPipe) -> None:
        self.pipe = pipe
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.pending: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.queued: list[bytes] = []
        self.flush_scheduled = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                fut, _ = self.pending.popleft()
                if fut.done():
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    text = str(reply)
                    fut.set_exception(NoScriptError(text) if text.startswith("NOSCRIPT") else ResponseError(text))
                else:
                    fut.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.fail(RedisConnectionError(f"Redis protocol error on the append connection ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError("the append connection to Redis closed"))

    def fail(self, exc: Exception) -> None:
        self.lost = True
        while self.pending:
            fut, _ = self.pending.popleft()
            if not fut.done():
                fut.set_exception(exc)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def send(self, packed: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = loop.create_future()
        self.pending.append((fut, time.monotonic()))
        self.queued.append(packed)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.transport is not None and not self.lost and self.queued:
            self.transport.write(b"".join(self.queued))
            self.pipe.writes += 1
        self.queued.clear()


class RedisPipe:
    def __init__(self, redis: aioredis.Redis, *, socket_timeout: float, connect_timeout: float) -> None:
        pool = redis.connection_pool
        kw = pool.connection_kwargs
        self._unix = pool.connection_class is UnixDomainSocketConnection
        self._host = kw.get("host", "localhost")
        self._port = int(kw.get("port", 6379))
        self._path = kw.get("path", "")
        self._username = kw.get("username")
        self._password = kw.get("password")
        self._db = int(kw.get("db", 0) or 0)
        self._socket_timeout = socket_timeout
        self._connect_timeout = connect_timeout
        self._proto: _Proto | None = None
        self._connecting: asyncio.Future[_Proto] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self.calls = 0
        self.writes = 0

    async def call(self, *args: str | bytes | int | float) -> Any:
        """One command; its reply (bytes, int, list). Raises ``ConnectionError``, ``ResponseError``."""
        proto = self._proto
        if proto is None or proto.lost:
            proto = await self._connect()
        return await self._send(proto, args)

    def send_packed_nowait(self, packed: bytes) -> asyncio.Future[Any] | None:
        """Queue one command already packed as RESP (``hiredis.pack_command``'s output) on the live
        connection and return its reply's future, or None when there is no live connection (then ``call``,
        which connects). The future raises what ``call`` raises."""
        proto = self._proto
        if proto is None or proto.lost:
            return None
        return self._send_packed(proto, packed)

    def _send(self, proto: _Proto, args: tuple[str | bytes | int | float, ...]) -> asyncio.Future[Any]:
        return self._send_packed(proto, hiredis.pack_command(cast(Any, args)))

    def _send_packed(self, proto: _Proto, packed: bytes) -> asyncio.Future[Any]:
        self.calls += 1
        loop = asyncio.get_running_loop()
        fut = proto.send(packed, loop)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._socket_timeout, self._check, proto)
        return fut

    def _check(self, proto: _Proto) -> None:
        """A reply overdue past the socket timeout: the connection is treated as broken (a frozen Redis
        or a partition is noticed, not waited on forever)."""
        self._watchdog = None
        if proto.lost or not proto.pending:
            return
        oldest = proto.pending[0][1]
        if time.monotonic() - oldest >= self._socket_timeout:
            proto.fail(RedisTimeoutError(f"no reply from Redis within {self._socket_timeout:g}s"))
            return
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self._socket_timeout, self._check, proto)

    async def _connect(self) -> _Proto:
        if self._connecting is not None:
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            proto = await self._open(loop)
        except BaseException as exc:
            err = exc if isinstance(exc, Exception) else RedisConnectionError("connect cancelled")
            self._connecting.set_exception(err)
            self._connecting.exception()  # retrieved: waiters get it, nobody else must log it
            self._connecting = None
            raise
        self._proto = proto
        self._connecting.set_result(proto)
        self._connecting = None
        return proto

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Proto:
        proto = _Proto(self)
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._unix:
                    await loop.create_unix_connection(lambda: proto, self._path)
                else:
                    await loop.create_connection(lambda: proto, self._host, self._port)
                # The hand-shake goes through the pipe itself: its replies are checked like any other.
                if self._password:
                    auth = (self._username, self._password) if self._username else (self._password,)
                    await proto.send(hiredis.pack_command(cast(Any, ("AUTH", *auth))), loop)
                if self._db:
                    await proto.send(hiredis.pack_command(cast(Any, ("SELECT", self._db))), loop)
        except TimeoutError:
            proto.fail(RedisConnectionError("connect to Redis timed out"))
            raise RedisTimeoutError("connecting the append connection to Redis timed out") from None
        except OSError as exc:
            raise RedisConnectionError(f"could not connect the append connection to Redis ({exc})") from exc
        except ResponseError:
            proto.fail(RedisConnectionError("hand-shake refused"))
            raise
        except BaseException:
            proto.fail(RedisConnectionError("connect cancelled"))
            raise
        return proto

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._proto is not None:
            self._proto.fail(RedisConnectionError("the append connection was closed"))
            self._proto = None

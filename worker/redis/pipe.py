"""One dedicated Redis connection for the worker's appends: hand-packed RESP, pipelined across streams.

Rule: every call queued during one event-loop tick goes out in one ``write`` (no timer: an idle worker
sends each call at once, a busy one many per write); replies are parsed in C by hiredis and answered in
order. A connection failure, or a reply later than ``socket_timeout``, fails every call in flight with
redis-py's ``ConnectionError`` (callers retry: appends are idempotent) and the next call reconnects.
Each connection has a process-unique id (``connection_id``): a caller that must know its command goes on
the connection an earlier reply came on (an append after acknowledged appends: a new connection may reach
a promoted replica that lacks them) names it, and the call raises ``ConnectionChanged`` instead of sending
on another. Error replies raise ``ResponseError`` for their own call only (a cluster's redirects and
refusals as redis-py's ``MovedError``, ``AskError``, ``TryAgainError``, ``ClusterDownError``, so a router
can follow them).

Why not redis-py's pipeline: per call it packs arguments in Python, takes a pooled connection and awaits
each reply under its own timeout; that was a fifth of the worker's CPU per paced event. The pipe speaks
plain TCP, TLS (``rediss://``, with the TLS options redis-py read from the URL) and Unix sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import AskError, ClusterDownError, MovedError, NoScriptError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ConnectionChanged", "Endpoint", "RedisPipe", "reply_error"]

_CONNECTION_IDS = itertools.count(1)


class ConnectionChanged(Exception):
    """The call named a connection that is gone: nothing was sent (the caller checks what Redis holds)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a pipe connects and how it shakes hands: a TCP node (``host``, ``port``) or a Unix socket
    (``path``); credentials, database and TLS context as the URL gave them."""

    host: str = "localhost"
    port: int = 6379
    path: str = ""
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: ssl.SSLContext | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.path, 0) if self.path else (self.host, self.port)

    def at(self, address: tuple[str, int]) -> Endpoint:
        """Another node of the same deployment (a cluster's): the same credentials and TLS."""
        return replace(self, host=address[0], port=address[1], path="")

    @classmethod
    def of(cls, redis: aioredis.Redis) -> Endpoint:
        """The server a redis-py client connects to, with its credentials, database and TLS options."""
        pool = redis.connection_pool
        kw = pool.connection_kwargs
        tls = None
        if issubclass(pool.connection_class, SSLConnection):
            # redis-py's own reading of the ssl_* options (ca_certs, cert_reqs, check_hostname, ...).
            tls = SSLConnection(**kw).ssl_context.get()
        unix = issubclass(pool.connection_class, UnixDomainSocketConnection)
        return cls(
            host=kw.get("host", "localhost"),
            port=int(kw.get("port", 6379)),
            path=kw.get("path", "") if unix else "",
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db", 0) or 0),
            tls=tls,
        )


def reply_error(text: str) -> ResponseError:
    """An error reply as redis-py's exception for it (the cluster redirects parse their target)."""
    head, _, rest = text.partition(" ")
    if head == "MOVED":
        return MovedError(rest)
    if head == "ASK":
        return AskError(rest)
    if head == "TRYAGAIN":
        return TryAgainError(text)
    if head in ("CLUSTERDOWN", "MASTERDOWN"):
        return ClusterDownError(text)
    return NoScriptError(text) if head == "NOSCRIPT" else ResponseError(text)


class _Proto(asyncio.Protocol):
    def __init__(self, pipe: RedisPipe) -> None:
        self.pipe = pipe
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.pending: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.queued: list[bytes] = []
        self.flush_scheduled = False
        self.waits: dict[tuple[int, int], asyncio.Future[Any]] = {}  # WAITs to write after this tick's commands
        self.lost = False
        self.id = next(_CONNECTION_IDS)

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
                    fut.set_exception(reply_error(str(reply)))
                else:
                    fut.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.fail(RedisConnectionError(f"Redis protocol error on the append connection ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError("the append connection to Redis closed"))

    def fail(self, exc: Exception) -> None:
        self.lost = True
        for fut in self.waits.values():
            if not fut.done():
                fut.set_exception(exc)
        self.waits.clear()
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

    def wait_after(self, params: tuple[int, int], loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        """The future of a ``WAIT *params`` written after every command queued this tick (shared)."""
        fut = self.waits.get(params)
        if fut is None:
            fut = self.waits[params] = loop.create_future()
        return fut

    def _flush(self) -> None:
        self.flush_scheduled = False
        for (replicas, timeout_ms), fut in self.waits.items():
            if self.lost:
                fut.set_exception(RedisConnectionError("the connection to Redis closed before WAIT was sent"))
                continue
            self.pending.append((fut, time.monotonic()))
            self.queued.append(hiredis.pack_command(cast(Any, ("WAIT", replicas, timeout_ms))))
        self.waits.clear()
        if self.transport is not None and not self.lost and self.queued:
            self.transport.write(b"".join(self.queued))
            self.pipe.writes += 1
        self.queued.clear()


class RedisPipe:
    def __init__(
        self,
        redis: aioredis.Redis | None = None,
        *,
        socket_timeout: float,
        connect_timeout: float,
        endpoint: Endpoint | None = None,
    ) -> None:
        """To the server ``redis`` (a redis-py client) connects to, else to ``endpoint``."""
        self._end = Endpoint.of(redis) if redis is not None else (endpoint or Endpoint())
        self._socket_timeout = socket_timeout
        self._connect_timeout = connect_timeout
        self._proto: _Proto | None = None
        self._connecting: asyncio.Future[_Proto] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self.calls = 0
        self.writes = 0

    @property
    def address(self) -> tuple[str, int]:
        return self._end.address

    @property
    def connection_id(self) -> int | None:
        """The id of the live connection, or None when the next call connects (a new id)."""
        proto = self._proto
        return None if proto is None or proto.lost else proto.id

    async def connect(self) -> int:
        """The live connection's id, connecting first if there is none. Raises ``ConnectionError``."""
        proto = self._proto
        if proto is None or proto.lost:
            proto = await self._connect()
        return proto.id

    async def call(self, *args: str | bytes | int | float) -> Any:
        """One command; its reply (bytes, int, list). Raises ``ConnectionError``, ``ResponseError``."""
        proto = self._proto
        if proto is None or proto.lost:
            proto = await self._connect()
        return await self._send(proto, args)

    async def request(
        self,
        args: tuple[str | bytes | int | float, ...],
        *,
        asking: bool = False,
        wait: tuple[int, int] | None = None,
        connection: int | None = None,
    ) -> tuple[Any, int | None]:
        """One command on this connection, optionally preceded by ``ASKING`` (a cluster's ASK redirect: the flag
        holds for the next command of the same connection only, so both go in one write) and followed by
        ``WAIT replicas timeout_ms`` (``wait``): (the command's reply, how many replicas acknowledged every
        write this connection made up to the WAIT, or None). Commands queued in the same loop tick share one
        WAIT written after all of them (group commit). With ``connection``, only on that connection (else
        ``ConnectionChanged``, nothing sent). Raises as ``call``."""
        proto = self._proto
        if proto is None or proto.lost:
            proto = await self._connect()
        if connection is not None and proto.id != connection:
            raise ConnectionChanged(f"connection {connection} to {self.address} is gone (now {proto.id})")
        asked = self._send(proto, ("ASKING",)) if asking else None
        fut = self._send(proto, args)
        waited = proto.wait_after(wait, asyncio.get_running_loop()) if wait is not None else None
        try:
            if asked is not None:
                with contextlib.suppress(ResponseError):  # the command's own reply says what happened
                    await asked
            reply = await fut
        except BaseException:
            for other in (asked, fut, waited):
                if other is not None:
                    other.add_done_callback(_consume)
            raise
        return reply, (int(await asyncio.shield(waited)) if waited is not None else None)

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
                end = self._end
                if end.path:
                    await loop.create_unix_connection(lambda: proto, end.path)
                else:
                    name = end.host if end.tls is not None else None
                    await loop.create_connection(lambda: proto, end.host, end.port, ssl=end.tls, server_hostname=name)
                # The hand-shake goes through the pipe itself: its replies are checked like any other.
                if end.password:
                    auth = (end.username, end.password) if end.username else (end.password,)
                    await proto.send(hiredis.pack_command(cast(Any, ("AUTH", *auth))), loop)
                if end.db:
                    await proto.send(hiredis.pack_command(cast(Any, ("SELECT", end.db))), loop)
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


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: whoever failed first already raised it

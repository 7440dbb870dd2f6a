"""A thin HTTP/1.1 client on an asyncio protocol: the worker's default upstream transport.

Rule: one request per connection at a time, HTTP/1.1 only; the response is parsed by the sans-IO
``worker/http/http1.py`` (tested against h11), this module only moves bytes and wakes the reader. What
fails is raised as ``worker/http/errors.py``'s types at the three places the outside world answers: the
connect (``_CONNECT``), the parser's faults (``RemoteProtocolError``) and the connection's end. ``gzip`` and
``deflate`` bodies are decoded as the reader takes room (never more than ``max_buffer`` decoded bytes at
once), other codings refused. The decoded body waits in a buffer of at most ``max_buffer`` bytes: past it
the socket stops being read, so a slow Redis turns into TCP back-pressure on the provider instead of
memory. ``receive(deadline)`` returns everything buffered at once (a chunk is not a message: one read may
hold many SSE events, or half of one) and honours the caller's deadline with a single loop timer, not a
cancel scope per read. Connections read to the end of their body are kept for the next request
(``keepalive_expiry``); any other ending closes the socket, so a cancel reaches the provider.

Why not only httpx (``worker/http/httpx_client.py``, selectable with ``http_client = "httpx"``): in the same
benchmark run (200 streams × 40 events/s) the worker spent 96 µs per event with httpx (h11 hands out one
HTTP chunk per read, each under a cancel scope) and 52 with this client (README, Benchmarks). It does not
use proxies from the environment: a worker whose routes need an egress proxy runs with httpx.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import cast
from urllib.parse import urlsplit

from sluice.worker.http.decoding import ContentDecoder, decoder_for
from sluice.worker.http.errors import (
    ConnectError,
    ConnectTimeout,
    HTTPError,
    InvalidHeader,
    InvalidURL,
    ReadError,
    RemoteProtocolError,
    map_exceptions,
)
from sluice.worker.http.http1 import Data, EndOfMessage, Event, HTTPProtocolError, Response, ResponseParser

__all__ = ["WireClient", "WireResponse"]

_MAX_HEAD = 64 * 1024
_MAX_CHUNK_LINE = 4 * 1024
_FORBIDDEN = frozenset("\r\n\0")
# TimeoutError first: it is an OSError too (asyncio.timeout's, or the kernel's ETIMEDOUT).
_CONNECT: dict[type[BaseException], type[HTTPError]] = {TimeoutError: ConnectTimeout, OSError: ConnectError}


class _Headers(Mapping[str, str]):
    """Response headers looked up by any case: names lower-cased, repeated names joined with ``, ``."""

    def __init__(self, fields: dict[str, str] | None = None) -> None:
        self._fields = fields or {}

    def __getitem__(self, key: str) -> str:
        return self._fields[key.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class _Conn(asyncio.Protocol):
    """One TCP (or TLS) connection: feeds what arrives to a sans-IO parser (``worker/http/http1.py``) and keeps
    the response's decoded body in ``body``, at most ``max_buffer`` bytes past which reading pauses."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: tuple[str, str, int], max_buffer: int) -> None:
        self.loop = loop
        self.origin = origin
        self.max_buffer = max_buffer
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = ResponseParser(max_head=_MAX_HEAD, max_line=_MAX_CHUNK_LINE)
        self.body = bytearray()  # decoded, not yet handed out
        self.status = 0
        self.headers = _Headers()
        self.head_done = False
        self.ended = False  # the parser saw the body's end
        self.done = False  # ... and every byte of it was decoded into ``body``
        self.keep_alive = True
        self.error: HTTPError | None = None
        self.eof = False
        self.paused = False
        self.waiter: asyncio.Future[bool] | None = None
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.decoder: ContentDecoder | None = None
        self.got_bytes = False

    # -- protocol callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence a cast rather than a check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            try:
                events = self.parser.feed(data)
            except HTTPProtocolError as exc:
                self._events(exc.events)  # what came before the fault is still handed out
                raise RemoteProtocolError(str(exc)) from exc
            self._events(events)
        except HTTPError as exc:
            self._fail(exc)
            return
        if self.parser.trailing:
            self.keep_alive = False  # bytes beyond the response: not a connection to reuse
        self._pause_if_full()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.keep_alive = False
        self._end_of_input(None)
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.keep_alive = False
        self._end_of_input(exc)
        self._wake()

    def _end_of_input(self, exc: Exception | None) -> None:
        if self.ended or self.error is not None:
            return
        try:
            if exc is not None:  # a reset is never the end of a body, even one delimited by the close
                raise ReadError("the connection closed inside the response") from exc
            try:
                self._events(self.parser.feed_eof())
            except HTTPProtocolError as e:
                raise RemoteProtocolError(str(e)) from e
        except HTTPError as failed:
            self._fail(failed)

    # -- the parser's events --

    def _events(self, events: list[Event]) -> None:
        for ev in events:
            if type(ev) is Data:
                if self.decoder is None:
                    self.body += ev.data
                else:
                    self.decoder.feed(ev.data)
                    self._decode()
            elif type(ev) is Response:
                self._head(ev)
            elif type(ev) is EndOfMessage:
                self.ended = True
                self._decode()

    def _head(self, ev: Response) -> None:
        fields: dict[str, str] = {}
        for name, value in ev.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            fields[key] = f"{fields[key]}, {text}" if key in fields else text
        self.status, self.headers = ev.status, _Headers(fields)
        headers = self.headers
        self.head_done = True
        if not self.parser.keep_alive:
            self.keep_alive = False
        # Decoded as the reader takes room (ContentDecoder), whatever was asked: a provider or proxy that
        # compresses anyway must not turn 200 KB into 200 MB of memory.
        self.decoder = decoder_for(headers.get("content-encoding"))

    def _decode(self) -> None:
        """Move decoded bytes into ``body`` while it has room; ``done`` once the body ended and all is out."""
        dec = self.decoder
        if dec is not None:
            room = self.max_buffer - len(self.body)
            if room > 0 and dec.pending:
                self.body += dec.read(room)
            if self.ended and not dec.pending:
                dec.close()
        if self.ended and (dec is None or not dec.pending):
            self.done = True

    def _pause_if_full(self) -> None:
        full = len(self.body) > self.max_buffer or (self.decoder is not None and self.decoder.pending)
        if full and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _fail(self, exc: HTTPError) -> None:
        if self.error is None:
            self.error = exc
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(True)

    # -- used by the response --

    async def wait(self, deadline: float | None) -> bool:
        """Wait for news (bytes, end, error). False when ``deadline`` (``time.monotonic``) passed first.
        One timer per connection, moved lazily: a stream's idle deadline moves on with every event, and
        re-arming a loop timer per read would cost more than the read."""
        if deadline is not None:
            delay = deadline - time.monotonic()
            if delay <= 0:
                return False
            if self.timer is None or self.timer_at > deadline:
                if self.timer is not None:
                    self.timer.cancel()
                self.timer = self.loop.call_later(delay, self._on_timer)
                self.timer_at = deadline
        self.deadline = deadline
        fut: asyncio.Future[bool] = self.loop.create_future()
        self.waiter = fut
        try:
            return await fut
        finally:
            self.waiter = None

    def _on_timer(self) -> None:
        self.timer = None
        if self.waiter is None or self.deadline is None:
            return
        remaining = self.deadline - time.monotonic()
        if remaining > 0:
            self.timer = self.loop.call_later(remaining, self._on_timer)
            self.timer_at = self.deadline
        elif not self.waiter.done():
            self.waiter.set_result(False)

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def take(self) -> bytes:
        data = bytes(self.body)
        self.body.clear()
        if self.decoder is not None:
            try:
                self._decode()  # the next piece, now that there is room
            except HTTPError as exc:
                self._fail(exc)
        room = len(self.body) <= self.max_buffer and not (self.decoder is not None and self.decoder.pending)
        if self.paused and self.transport is not None and not self.error and room:
            self.paused = False
            self.transport.resume_reading()
        return data


class WireResponse:
    def __init__(self, client: WireClient, conn: _Conn) -> None:
        self._client = client
        self._conn: _Conn | None = conn
        self.status_code = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def receive(self, deadline: float | None = None) -> bytes | None:
        """Every body byte buffered so far; waits when there is none. ``b""`` at the body's end, ``None``
        when ``deadline`` passed first. Raises ``HTTPError`` when the connection or the response broke."""
        conn = self._conn
        if conn is None:
            return b""
        while True:
            if conn.body:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.done:
                return b""
            if not await conn.wait(deadline):
                return None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while chunk := await self.receive():
            yield chunk

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._release(conn)


class WireClient:
    def __init__(
        self,
        max_connections: int,
        *,
        max_buffer: int = 32 * 1024,
        keepalive_expiry: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._max_idle = max_connections
        self._max_buffer = max_buffer
        self._expiry = keepalive_expiry
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._open: set[_Conn] = set()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, connect_timeout: float
    ) -> WireResponse:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise InvalidURL(f"only http(s) URLs with a host are supported ({scheme!r})")
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = _request_head(method, target, parts.netloc.rsplit("@", 1)[-1], headers, len(body)) + body
        conn = self._reuse(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, request)
            except HTTPError:
                if conn.got_bytes:
                    raise
                # The server had closed the idle connection before it saw the request: a fresh one.
        conn = await self._connect(origin, connect_timeout)
        return await self._exchange(conn, request)

    def _reuse(self, origin: tuple[str, str, int]) -> _Conn | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            stale = now - conn.idle_since > self._expiry
            if stale or conn.eof or conn.transport is None or conn.transport.is_closing():
                self._drop(conn)
                continue
            conn._reset()
            return conn
        return None

    async def _connect(self, origin: tuple[str, str, int], connect_timeout: float) -> _Conn:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        conn = _Conn(loop, origin, self._max_buffer)
        ctx = self._ssl_context() if scheme == "https" else None
        with map_exceptions(_CONNECT):
            async with asyncio.timeout(connect_timeout):
                await loop.create_connection(lambda: conn, host, port, ssl=ctx, server_hostname=host if ctx else None)
        self._open.add(conn)
        return conn

    async def _exchange(self, conn: _Conn, request: bytes) -> WireResponse:
        assert conn.transport is not None
        try:
            conn.transport.write(request)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(None)
        except BaseException:
            self._drop(conn)  # cancelled or broken before the head: the provider sees the socket close
            raise
        return WireResponse(self, conn)

    def _release(self, conn: _Conn) -> None:
        conn.stop_timer()
        if conn.done and conn.keep_alive and not conn.body and conn.error is None and not conn.eof:
            conn.idle_since = time.monotonic()
            idle = self._idle.setdefault(conn.origin, [])
            if len(idle) < self._max_idle:
                idle.append(conn)
                return
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        conn.stop_timer()
        self._open.discard(conn)
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()

    async def aclose(self) -> None:
        for conn in list(self._open):
            self._drop(conn)
        self._idle.clear()


def _request_head(method: str, target: str, host: str, headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    seen = {"host", "content-length", "transfer-encoding", "connection"}
    for name, value in headers.items():
        if _FORBIDDEN.intersection(name) or _FORBIDDEN.intersection(value) or ":" in name:
            # A header that would split the request: refused before anything is sent (never echoed).
            raise InvalidHeader(f"header {name[:40]!r} holds a line break or a colon")
        if name.lower() not in seen:
            lines.append(f"{name}: {value}")
    if not any(k.lower() == "accept-encoding" for k in headers):
        lines.append("accept-encoding: identity")  # compression would hold SSE events back at the server
    lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()

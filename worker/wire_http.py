"""A thin HTTP/1.1 client on an asyncio protocol: the worker's default upstream transport.

Rule: one request per connection at a time, HTTP/1.1 only, bodies framed by ``Transfer-Encoding: chunked``,
``Content-Length`` or the connection's end; ``gzip``/``deflate`` decoded, anything else refused. The
decoded body waits in a buffer of at most ``max_buffer`` bytes: past it the socket stops being read, so a
slow Redis turns into TCP back-pressure on the provider instead of memory. ``receive(deadline)`` returns
everything buffered at once (a chunk is not a message: one read may hold many SSE events, or half of one)
and honours the caller's deadline with a single loop timer, not a cancel scope per read. Connections read
to the end of their body are kept for the next request (``keepalive_expiry``); any other ending closes the
socket, so a cancel reaches the provider.

Why not httpx or aiohttp (both still selectable, ``worker/http_client.py``): in the same benchmark run (200
streams × 40 events/s) the worker spent 177 µs per event with httpx (h11 hands out one HTTP chunk per read,
each under a cancel scope), 108 with aiohttp, 102 with this client; and aiohttp kept buffering chunked
bodies when reading paused (+216 MiB RSS over 100 streams under a slow Redis). It does not speak HTTP/2 or
use proxies from the environment: a route that needs an egress proxy sets ``http_client = "httpx"``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

from sluice.worker.http_client import ConnectFailed, ReadFailed

__all__ = ["WireClient", "WireResponse"]

_MAX_HEAD = 64 * 1024
_MAX_CHUNK_LINE = 4 * 1024
_FORBIDDEN = frozenset("\r\n\0")


class _Headers(dict[str, str]):
    """Response headers, names lower-cased (repeated names joined with ``, ``)."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)


class _Conn(asyncio.Protocol):
    """One TCP (or TLS) connection: parses one response head, then de-frames its body into ``body``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: tuple[str, str, int], max_buffer: int) -> None:
        self.loop = loop
        self.origin = origin
        self.max_buffer = max_buffer
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.raw = bytearray()  # received, not yet parsed
        self.body = bytearray()  # de-framed, not yet handed out
        self.status = 0
        self.headers = _Headers()
        self.head_done = False
        self.done = False  # the body's framing ended
        self.keep_alive = True
        self.error: ReadFailed | None = None
        self.eof = False
        self.paused = False
        self.waiter: asyncio.Future[bool] | None = None
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.framing = "close"
        self.remaining = 0  # content-length left, or bytes left of the current chunk
        self.chunk_state = "size"  # size | data | crlf | trailer
        self.inflate: zlib._Decompress | None = None
        self.got_bytes = False

    # -- protocol callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence a cast rather than a check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.done:
            self.keep_alive = False  # bytes after the body: not a connection to reuse
            return
        self.raw += data
        try:
            if not self.head_done:
                self._parse_head()
            if self.head_done:
                self._parse_body()
                if self.done and self.raw:
                    self.keep_alive = False  # bytes beyond the response: not a connection to reuse
        except ReadFailed as exc:
            self._fail(exc)
            return
        if len(self.body) > self.max_buffer and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.keep_alive = False
        if self.head_done and not self.done and self.framing == "close":
            self._finish()
        elif not self.done:
            self._fail(ReadFailed("RemoteProtocolError: the peer closed the connection inside the response"))
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.keep_alive = False
        if not self.done and self.error is None:
            if self.head_done and self.framing == "close" and exc is None:
                self._finish()
            else:
                name = type(exc).__name__ if exc is not None else "RemoteProtocolError"
                self._fail(ReadFailed(f"{name}: the connection closed inside the response"))
        self._wake()

    # -- parsing --

    def _parse_head(self) -> None:
        while True:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                if len(self.raw) > _MAX_HEAD:
                    raise ReadFailed("RemoteProtocolError: response head too large")
                return
            head = bytes(self.raw[:end]).decode("latin-1")
            del self.raw[: end + 4]
            lines = head.split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise ReadFailed(f"RemoteProtocolError: not an HTTP/1.x status line {lines[0][:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:
                continue  # an interim response (103 Early Hints): the real one follows
            headers = _Headers()
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise ReadFailed("RemoteProtocolError: malformed response header line")
                key = name.strip().lower()
                value = value.strip()
                headers[key] = f"{headers[key]}, {value}" if key in headers else value
            self.status, self.headers = status, headers
            self.head_done = True
            if parts[0] == "HTTP/1.0" or "close" in (headers.get("connection") or "").lower():
                self.keep_alive = False
            self._choose_framing()
            return

    def _choose_framing(self) -> None:
        te = (self.headers.get("transfer-encoding") or "").lower()
        if self.status in (204, 304):  # never a body, whatever the headers say (RFC 9112 §6.3)
            self.framing = "length"
            self._finish()
        elif "chunked" in te:
            self.framing = "chunked"
        elif "content-length" in self.headers:
            try:
                self.remaining = int(self.headers["content-length"])
            except ValueError:
                raise ReadFailed("RemoteProtocolError: bad content-length") from None
            self.framing = "length"
            if self.remaining == 0:
                self._finish()
        else:
            self.framing = "close"
            self.keep_alive = False
        enc = (self.headers.get("content-encoding") or "identity").lower().strip()
        if enc in ("gzip", "x-gzip"):
            self.inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self.inflate = zlib.decompressobj()
        elif enc not in ("identity", ""):
            raise ReadFailed(f"RemoteProtocolError: unsupported content-encoding {enc!r}")

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        if self.inflate is not None:
            try:
                data = self.inflate.decompress(data)
            except zlib.error as exc:
                raise ReadFailed(f"DecodingError: {exc}") from None
        self.body += data

    def _parse_body(self) -> None:
        if self.framing == "close":
            self._emit(self.raw)
            self.raw.clear()
        elif self.framing == "length":
            take = min(self.remaining, len(self.raw))
            self._emit(memoryview(self.raw)[:take])
            del self.raw[:take]
            self.remaining -= take
            if self.remaining == 0:
                self._finish()
        else:
            self._parse_chunked()

    def _parse_chunked(self) -> None:
        raw = self.raw
        pos = 0
        n = len(raw)
        while not self.done:
            state = self.chunk_state
            if state == "data":
                take = min(self.remaining, n - pos)
                if take == 0:
                    break
                self._emit(memoryview(raw)[pos : pos + take])
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.chunk_state = "crlf"
            elif state == "crlf":
                if n - pos < 2:
                    break
                if raw[pos : pos + 2] != b"\r\n":
                    raise ReadFailed("RemoteProtocolError: chunk data not followed by CRLF")
                pos += 2
                self.chunk_state = "size"
            else:
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > _MAX_CHUNK_LINE:
                        raise ReadFailed("RemoteProtocolError: chunk size line too long")
                    break
                line = bytes(raw[pos:end])
                pos = end + 2
                if state == "trailer":
                    if not line:
                        self._finish()
                    continue
                size = line.split(b";", 1)[0].strip()
                try:
                    self.remaining = int(size, 16)
                except ValueError:
                    raise ReadFailed("RemoteProtocolError: bad chunk size") from None
                if self.remaining < 0:
                    raise ReadFailed("RemoteProtocolError: bad chunk size")
                self.chunk_state = "data" if self.remaining else "trailer"
        del raw[:pos]

    def _finish(self) -> None:
        if self.inflate is not None:
            try:
                self.body += self.inflate.flush()
            except zlib.error as exc:
                self._fail(ReadFailed(f"DecodingError: {exc}"))
                return
        self.done = True

    def _fail(self, exc: ReadFailed) -> None:
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
        if self.paused and self.transport is not None:
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
        when ``deadline`` passed first. Raises ``ReadFailed`` when the connection broke."""
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
        self, max_connections: int, *, max_buffer: int = 32 * 1024, keepalive_expiry: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
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
            raise ConnectFailed(f"InvalidURL: only http(s) URLs with a host are supported ({scheme!r})")
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = _request_head(method, target, parts.netloc.rsplit("@", 1)[-1], headers, len(body)) + body
        conn = self._reuse(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, request)
            except ReadFailed:
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
        try:
            async with asyncio.timeout(connect_timeout):
                await loop.create_connection(lambda: conn, host, port, ssl=ctx, server_hostname=host if ctx else None)
        except TimeoutError:
            raise ConnectFailed("ConnectTimeout") from None
        except OSError as exc:
            raise ConnectFailed(type(exc).__name__) from exc
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
            raise ConnectFailed(f"InvalidHeader: header {name[:40]!r} holds a line break or a colon")
        if name.lower() not in seen:
            lines.append(f"{name}: {value}")
    if not any(k.lower() == "accept-encoding" for k in headers):
        lines.append("accept-encoding: identity")  # compression would hold SSE events back at the server
    lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()

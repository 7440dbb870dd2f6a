"""The upstream HTTP client behind one small interface, so the transport is chosen on measurements.

Rule: the worker needs only ``open`` (send the request, return once the response headers are in) and a
response with ``status_code``, ``headers``, ``receive(deadline)`` (the body bytes buffered so far, content-
decoded; ``b""`` at the end, ``None`` when the deadline passed), ``aiter_raw()`` and ``aclose()`` (closes
the connection unless the body was read to its end, so a cancel reaches the provider). Failures are mapped
at this edge, with one table per library, into ``ConnectFailed`` (nothing was sent) and ``ReadFailed`` (the
connection broke).

``wire`` (``worker/wire_http.py``, the default) reads cheapest and keeps a bounded buffer. ``httpx`` is here
for workers behind an egress proxy (it honours the proxy environment variables); it speaks HTTP/1.1 here,
as the wire client does (HTTP/2 would need the ``h2`` package and buys a streaming response nothing). The
choice is per worker process (``http_client`` in the configuration). aiohttp was measured and dropped: it
buffered chunked bodies without bound when reading paused (+216 MiB of worker RSS over 100 streams under
a slow Redis, where httpx grew 12 MiB). Either client decodes gzip/deflate only as fast as the reader takes
it (``ContentDecoder``), so a compressed body never inflates in memory beyond one read's room.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import anyio
import httpx

from sluice.worker.config import HTTP_CLIENTS, HttpClientName

__all__ = [
    "HTTP_CLIENTS",
    "ConnectFailed",
    "ContentDecoder",
    "HttpClient",
    "HttpClientName",
    "ReadFailed",
    "UpstreamResponse",
    "make_http_client",
]



class ConnectFailed(Exception):
    """The provider could not be reached; nothing was sent."""


class ReadFailed(Exception):
    """The connection broke (before or during the response)."""


class ContentDecoder:
    """``gzip`` / ``deflate`` decoding whose output the reader bounds: ``feed`` keeps compressed bytes,
    ``read(limit)`` inflates at most ``limit`` bytes of them. A body that inflates a thousandfold (a
    "gzip bomb") is never in memory beyond what the reader has room for; the rest waits compressed."""

    def __init__(self, encoding: str) -> None:
        self._z = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS)
        self._queue: deque[bytes] = deque()
        self._tail = b""  # input zlib took no output room for yet
        self._more = False  # the last read filled its limit: zlib may hold output for input it took

    @property
    def pending(self) -> bool:
        return bool(self._tail or self._queue or self._more)

    def feed(self, data: bytes) -> None:
        if data:
            self._queue.append(data)

    def read(self, limit: int) -> bytes:
        """At most ``limit`` decoded bytes. Raises ``ReadFailed`` on a corrupt stream."""
        out = bytearray()
        while len(out) < limit and self.pending:
            data = self._tail or (self._queue.popleft() if self._queue else b"")
            room = limit - len(out)
            try:
                piece = self._z.decompress(data, room)
            except zlib.error as exc:
                raise ReadFailed(f"DecodingError: {exc}") from None
            self._tail = self._z.unconsumed_tail
            self._more = len(piece) == room
            out += piece
        return bytes(out)

    def close(self) -> None:
        """The body ended. Raises ``ReadFailed`` when the compressed stream was cut short."""
        if not self._z.eof:
            raise ReadFailed("DecodingError: the compressed body ended early")


class UpstreamResponse(Protocol):
    status_code: int
    headers: Mapping[str, str]

    async def receive(self, deadline: float | None = None) -> bytes | None:
        """The body bytes that arrived (waiting for some): ``b""`` at the body's end, ``None`` when
        ``deadline`` (``time.monotonic``) passed first. Raises ``ReadFailed``."""
        ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class HttpClient(Protocol):
    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, connect_timeout: float
    ) -> UpstreamResponse:
        """Raises ``ConnectFailed`` or ``ReadFailed``."""
        ...

    async def aclose(self) -> None: ...


def _name(exc: BaseException) -> str:
    return type(exc).__name__


_DECODED_PIECE = 32 * 1024  # the wire client's buffer bound, for httpx's decoded reads


class _IteratorReceive:
    """``receive`` over a library's chunk iterator, under one cancel scope per read (what the wire client
    avoids)."""

    _chunks: AsyncIterator[bytes] | None = None

    def aiter_raw(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def receive(self, deadline: float | None = None) -> bytes | None:
        if self._chunks is None:
            self._chunks = self.aiter_raw()
        with anyio.move_on_after(None if deadline is None else max(0.0, deadline - time.monotonic())):
            try:
                return await self._chunks.__anext__()
            except StopAsyncIteration:
                return b""
        return None


# -- httpx ------------------------------------------------------------------------------------------------

_HTTPX_CONNECT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_HTTPX_READ = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout, httpx.WriteError, httpx.WriteTimeout)


class _HttpxResponse(_IteratorReceive):
    def __init__(self, response: httpx.Response) -> None:
        self._r = response
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = response.headers
        # httpx's own decoding inflates a whole read at once; the raw bytes go through ContentDecoder.
        enc = (response.headers.get("content-encoding") or "identity").lower().strip()
        self._decoder = ContentDecoder(enc) if enc in ("gzip", "x-gzip", "deflate") else None
        self._unsupported = enc if self._decoder is None and enc not in ("identity", "") else None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._unsupported is not None:
            raise ReadFailed(f"RemoteProtocolError: unsupported content-encoding {self._unsupported!r}")
        dec = self._decoder
        try:
            async for chunk in self._r.aiter_raw():
                if dec is None:
                    yield chunk
                    continue
                dec.feed(chunk)
                while dec.pending:
                    if piece := dec.read(_DECODED_PIECE):
                        yield piece
        except _HTTPX_READ as exc:
            raise ReadFailed(_name(exc)) from exc
        if dec is not None:
            dec.close()

    async def aclose(self) -> None:
        await self._r.aclose()


class HttpxClient:
    def __init__(self, max_connections: int) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_connections),
            follow_redirects=False,
        )

    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, connect_timeout: float
    ) -> UpstreamResponse:
        timeout = httpx.Timeout(connect=connect_timeout, read=None, write=connect_timeout, pool=connect_timeout)
        hdrs = dict(headers)
        if not any(k.lower() == "accept-encoding" for k in hdrs):
            hdrs["accept-encoding"] = "identity"  # as the wire client: compression holds SSE events back
        request = self._client.build_request(method, url, headers=hdrs, content=body, timeout=timeout)
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except _HTTPX_CONNECT as exc:
            raise ConnectFailed(_name(exc)) from exc
        except _HTTPX_READ as exc:
            raise ReadFailed(_name(exc)) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


def make_http_client(name: HttpClientName, max_connections: int) -> HttpClient:
    if name == "wire":
        from sluice.worker.wire_http import WireClient

        return WireClient(max_connections)
    return HttpxClient(max_connections)

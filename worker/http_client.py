"""The upstream HTTP client behind one small interface, so the transport is chosen on measurements.

Rule: the worker needs only ``open`` (send the request, return once the response headers are in) and a
response with ``status_code``, ``headers``, ``receive(deadline)`` (the body bytes buffered so far, content-
decoded; ``b""`` at the end, ``None`` when the deadline passed), ``aiter_raw()`` and ``aclose()`` (closes
the connection unless the body was read to its end, so a cancel reaches the provider). Failures are mapped
at this edge, with one table per library, into ``ConnectFailed`` (nothing was sent) and ``ReadFailed`` (the
connection broke).

``wire`` (``worker/wire_http.py``, the default) reads cheapest and keeps a bounded buffer. ``httpx`` is here
for routes behind an egress proxy (it honours the proxy environment) or needing HTTP/2; ``aiohttp`` reads
cheaply too but kept buffering chunked bodies when reading paused (the worker's RSS grew by 216 MiB over
100 streams under a slow Redis, where httpx grew 12 MiB).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Literal, Protocol

import aiohttp
import anyio
import httpx

__all__ = ["ConnectFailed", "HttpClient", "ReadFailed", "UpstreamResponse", "make_http_client"]

HttpClientName = Literal["wire", "aiohttp", "httpx"]


class ConnectFailed(Exception):
    """The provider could not be reached; nothing was sent."""


class ReadFailed(Exception):
    """The connection broke (before or during the response)."""


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

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.aiter_bytes():
                yield chunk
        except _HTTPX_READ as exc:
            raise ReadFailed(_name(exc)) from exc

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
        request = self._client.build_request(method, url, headers=dict(headers), content=body, timeout=timeout)
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except _HTTPX_CONNECT as exc:
            raise ConnectFailed(_name(exc)) from exc
        except _HTTPX_READ as exc:
            raise ReadFailed(_name(exc)) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


# -- aiohttp ----------------------------------------------------------------------------------------------

_AIOHTTP_CONNECT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_AIOHTTP_READ = (aiohttp.ClientError, OSError, TimeoutError)


class _AiohttpResponse(_IteratorReceive):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._r = response
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers
        self._complete = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.content.iter_any():
                yield chunk
        except _AIOHTTP_READ as exc:
            raise ReadFailed(_name(exc)) from exc
        self._complete = True

    async def aclose(self) -> None:
        if self._complete:
            self._r.release()  # read to the end: the connection may serve the next request
        else:
            self._r.close()  # closes the socket: the provider sees the client go away


class AiohttpClient:
    def __init__(self, max_connections: int) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._max = max_connections

    def _get(self) -> aiohttp.ClientSession:
        # Created on first use, inside the running event loop (aiohttp binds a session to its loop).
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                auto_decompress=True,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, connect_timeout: float
    ) -> UpstreamResponse:
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout)
        try:
            response = await self._get().request(
                method, url, headers=dict(headers), data=body, timeout=timeout, allow_redirects=False
            )
        except _AIOHTTP_CONNECT as exc:
            raise ConnectFailed(_name(exc)) from exc
        except _AIOHTTP_READ as exc:
            raise ReadFailed(_name(exc)) from exc
        return _AiohttpResponse(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def make_http_client(name: HttpClientName, max_connections: int) -> HttpClient:
    if name == "wire":
        from sluice.worker.wire_http import WireClient

        return WireClient(max_connections)
    if name == "httpx":
        return HttpxClient(max_connections)
    return AiohttpClient(max_connections)

"""The upstream client over httpx, for workers behind an egress proxy (``http_client = "httpx"``).

Rule: httpx's exceptions are mapped once, by ``_HTTPX`` (one entry per kind, ``raise ... from exc``), at the
two places httpx is called (``send`` and the body iterator); httpx's own messages are dropped (they may
echo a URL). httpx's decoding would inflate a whole read at once, so raw bytes go through
``ContentDecoder`` in pieces of the wire client's buffer bound.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping

import anyio
import httpx

from sluice.worker.http.client import UpstreamResponse
from sluice.worker.http.decoding import ContentDecoder, decoder_for
from sluice.worker.http.errors import (
    ConnectError,
    ConnectTimeout,
    HTTPError,
    InvalidURL,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    WriteError,
    WriteTimeout,
    map_exceptions,
)

__all__ = ["HttpxClient"]

_HTTPX: dict[type[BaseException], type[HTTPError]] = {
    httpx.ConnectError: ConnectError,
    httpx.ConnectTimeout: ConnectTimeout,
    httpx.PoolTimeout: PoolTimeout,
    httpx.ReadError: ReadError,
    httpx.RemoteProtocolError: RemoteProtocolError,
    httpx.ReadTimeout: ReadTimeout,
    httpx.WriteError: WriteError,
    httpx.WriteTimeout: WriteTimeout,
    httpx.UnsupportedProtocol: InvalidURL,
    httpx.InvalidURL: InvalidURL,
}
_DECODED_PIECE = 32 * 1024  # the wire client's buffer bound, for httpx's decoded reads


class _HttpxResponse:
    _chunks: AsyncIterator[bytes] | None = None

    def __init__(self, response: httpx.Response) -> None:
        self._r = response
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = response.headers
        self._decoder: ContentDecoder | None = None
        self._refused: RemoteProtocolError | None = None  # raised on the first read, as the wire client does
        try:
            self._decoder = decoder_for(response.headers.get("content-encoding"))
        except RemoteProtocolError as exc:
            self._refused = exc

    async def receive(self, deadline: float | None = None) -> bytes | None:
        # Under one cancel scope per read: what the wire client avoids.
        if self._chunks is None:
            self._chunks = self.aiter_raw()
        with anyio.move_on_after(None if deadline is None else max(0.0, deadline - time.monotonic())):
            try:
                return await self._chunks.__anext__()
            except StopAsyncIteration:
                return b""
        return None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._refused is not None:
            raise self._refused
        dec = self._decoder
        with map_exceptions(_HTTPX):
            async for chunk in self._r.aiter_raw():
                if dec is None:
                    yield chunk
                    continue
                dec.feed(chunk)
                while dec.pending:
                    if piece := dec.read(_DECODED_PIECE):
                        yield piece
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
        with map_exceptions(_HTTPX):
            request = self._client.build_request(method, url, headers=hdrs, content=body, timeout=timeout)
            return _HttpxResponse(await self._client.send(request, stream=True))

    async def aclose(self) -> None:
        await self._client.aclose()

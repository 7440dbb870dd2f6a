"""The upstream HTTP client behind one small interface, so the transport is chosen on measurements.

Rule: the worker needs only ``open`` (send the request, return once the response headers are in) and a
response with ``status_code``, ``headers``, ``receive(deadline)`` (the body bytes buffered so far, content-
decoded; ``b""`` at the end, ``None`` when the deadline passed), ``aiter_raw()`` and ``aclose()`` (closes
the connection unless the body was read to its end, so a cancel reaches the provider). Both raise only the
typed failures of ``worker/http/errors.py``, each client mapping its library's at one boundary.

``wire`` (``worker/http/wire.py``, the default) reads cheapest and keeps a bounded buffer. ``httpx``
(``worker/http/httpx_client.py``) is here for workers behind an egress proxy (it honours the proxy
environment variables); it speaks HTTP/1.1 here, as the wire client does (HTTP/2 would need the ``h2``
package and buys a streaming response nothing). The choice is per worker process (``http_client`` in the
configuration). aiohttp was measured and dropped: it buffered chunked bodies without bound when reading
paused (+216 MiB of worker RSS over 100 streams under a slow Redis, where httpx grew 12 MiB). Either client
decodes gzip/deflate only as fast as the reader takes it (``worker/http/decoding.py``), so a compressed body
never inflates in memory beyond one read's room.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from sluice.worker.config import HttpClientName

__all__ = ["HttpClient", "UpstreamResponse", "make_http_client"]


class UpstreamResponse(Protocol):
    status_code: int
    headers: Mapping[str, str]

    async def receive(self, deadline: float | None = None) -> bytes | None:
        """The body bytes that arrived (waiting for some): ``b""`` at the body's end, ``None`` when
        ``deadline`` (``time.monotonic``) passed first. Raises ``HTTPError``."""
        ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class HttpClient(Protocol):
    async def open(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, connect_timeout: float
    ) -> UpstreamResponse:
        """Raises ``HTTPError`` (``NOT_SENT`` when the provider never saw the request)."""
        ...

    async def aclose(self) -> None: ...


def make_http_client(name: HttpClientName, max_connections: int) -> HttpClient:
    # Imported on use: a worker runs one client, and the wire client's needs no httpx.
    if name == "wire":
        from sluice.worker.http.wire import WireClient

        return WireClient(max_connections)
    from sluice.worker.http.httpx_client import HttpxClient

    return HttpxClient(max_connections)

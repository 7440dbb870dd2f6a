"""The wire client over real sockets: connection reuse, a stale idle connection, deadlines, back-pressure,
cancellation reaching the server, connect failures; on asyncio and on uvloop."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trustme
import uvloop

from sluice.worker.http.errors import ConnectError, InvalidURL, ReadError, RemoteProtocolError
from sluice.worker.http.wire import WireClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _Server:
    def __init__(self) -> None:
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.port = 0


@asynccontextmanager
async def _serve(
    handler: Callable[[_Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[_Server]:
    state = _Server()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(state, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def _until(predicate: Callable[[], bool], limit: float = 10.0) -> None:
    """Until ``predicate()`` holds (state the event loop's callbacks change; polled)."""
    async with asyncio.timeout(limit):
        while not predicate():  # noqa: ASYNC110 - the state is a protocol's attributes, nothing to await
            await asyncio.sleep(0.005)


def _both_loops(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())
    uvloop.run(fn())


async def _read_all(client: WireClient, url: str) -> tuple[int, bytes]:
    r = await client.open("POST", url, {"x-a": "1"}, b"{}", 5)
    out = b""
    while chunk := await r.receive(time.monotonic() + 5):
        out += chunk
    await r.aclose()
    return r.status_code, out


def test_keep_alive_reuses_the_connection_and_a_stale_one_is_replaced() -> None:
    async def main() -> None:
        async def handler(state: _Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(2):  # two requests per connection, then the server closes it while idle
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
                await writer.drain()

        async with _serve(handler) as srv:
            client = WireClient(4)
            url = f"http://127.0.0.1:{srv.port}/v1/x"
            results = [await _read_all(client, url) for _ in range(3)]  # the third finds a closed idle connection
            await client.aclose()
        assert results == [(200, b"abc")] * 3
        assert srv.connections == 2

    _both_loops(main)


def test_deadline_returns_none_and_cancel_closes_the_socket() -> None:
    async def main() -> None:
        async def handler(state: _Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
            await writer.drain()
            if await reader.read(1) == b"":  # the client went away
                state.closed_by_client.set()

        async with _serve(handler) as srv:
            client = WireClient(4)
            r = await client.open("POST", f"http://127.0.0.1:{srv.port}/", {}, b"", 5)
            assert await r.receive(time.monotonic() + 5) == b"hi"
            started = time.monotonic()
            assert await r.receive(time.monotonic() + 0.2) is None  # nothing more: the deadline answers
            assert time.monotonic() - started >= 0.15
            task = asyncio.ensure_future(r.receive(None))
            conn = r._conn
            assert conn is not None
            await _until(lambda: conn.waiter is not None)  # the read is waiting on the socket
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await r.aclose()  # the body did not end: the socket is closed, not pooled
            await asyncio.wait_for(srv.closed_by_client.wait(), 5)
            await client.aclose()

    _both_loops(main)


def test_a_slow_reader_holds_a_bounded_buffer() -> None:
    async def main() -> None:
        sent = 0
        server_writer: asyncio.StreamWriter | None = None

        def server_blocked() -> bool:
            """The server's drain() waits: its buffer is past the high-water mark (the kernel's are full)."""
            if server_writer is None:
                return False
            transport = server_writer.transport
            return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]

        async def handler(state: _Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sent, server_writer
            server_writer = writer
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            piece = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
            for _ in range(2000):  # 32 MiB, far beyond the socket buffers
                writer.write(piece)
                await writer.drain()
                sent += 0x4000
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        async with _serve(handler) as srv:
            client = WireClient(4, max_buffer=64 * 1024)
            r = await client.open("POST", f"http://127.0.0.1:{srv.port}/", {}, b"", 5)
            conn = r._conn
            assert conn is not None
            await _until(lambda: conn.paused and server_blocked())  # not reading: the server blocks on its writes
            assert len(conn.body) <= 64 * 1024 + 256 * 1024  # the bound plus at most one socket read
            assert sent < 16 * 1024 * 1024
            total = 0
            while chunk := await r.receive(time.monotonic() + 10):
                total += len(chunk)
            assert total == 2000 * 0x4000
            await r.aclose()
            await client.aclose()

    _both_loops(main)


def test_connect_failures_and_a_reset_before_the_head_are_typed() -> None:
    async def main() -> None:
        client = WireClient(4)
        with pytest.raises(ConnectError, match="ConnectionRefusedError"):
            await client.open("POST", "http://127.0.0.1:1/", {}, b"", 2)
        with pytest.raises(InvalidURL, match="InvalidURL"):
            await client.open("POST", "ftp://example.com/", {}, b"", 2)

        async def handler(state: _Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.transport.abort()

        async with _serve(handler) as srv:
            with pytest.raises((ReadError, RemoteProtocolError)):
                await client.open("POST", f"http://127.0.0.1:{srv.port}/", {}, b"", 2)
        await client.aclose()

    _both_loops(main)


def test_https_verifies_the_certificate_and_streams() -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)

    async def main() -> None:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
                await writer.drain()
            except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            trusting = ssl.create_default_context()
            ca.configure_trust(trusting)
            client = WireClient(4, ssl_context=trusting)
            assert await _read_all(client, f"https://localhost:{port}/v1/x") == (200, b"hello")
            await client.aclose()
            default = WireClient(4)  # the system's trust store does not know this CA
            with pytest.raises(ConnectError, match="SSLCertVerificationError"):
                await default.open("POST", f"https://localhost:{port}/", {}, b"", 5)
            await default.aclose()
        finally:
            server.close()

    _both_loops(main)

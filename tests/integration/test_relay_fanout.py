"""Fan-out: many clients on one request share one Redis reader; a client that stops reading is cut off
without slowing Redis reading or the other clients."""

from __future__ import annotations

import base64
import logging
import os
import socket
import time

import anyio
import httpx
import pytest

from sluice.relay import serve_relay
from tests.integration.conftest import cleanup
from tests.integration.test_relay import (
    AUTH,
    SECRET,
    Attempt,
    Received,
    config_for,
    events_url,
    finalize,
    publish,
    read_sse,
    stored,
    wait_until,
)

pytestmark = pytest.mark.asyncio


async def test_200_clients_identical_streams_one_reader(redis_url, key_prefix, redis_client) -> None:
    a = Attempt("fan", 1).block("text", [f"tok{i} " for i in range(60)]).block("text", ["¡fin!"]).done()
    await publish(redis_client, key_prefix, "fan", 1, a.events[:5])
    n = 200
    try:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient(limits=limits) as client:
            url = events_url(relay.url, "fan")
            results: list[Received] = []

            async def reader() -> None:
                results.append(await read_sse(client, url, headers=AUTH))

            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(reader)
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == n)
                for i in range(5, len(a.events), 4):
                    await publish(redis_client, key_prefix, "fan", 1, a.events[i : i + 4])
                    await anyio.sleep(0.005)
                await finalize(redis_client, key_prefix, "fan")
            log = await stored(redis_client, key_prefix, "fan")
            stats = relay.hub.statistics()
        assert len(results) == n
        assert all(r.contract == log and r.ended for r in results)
        # one reader for the request, however many clients: its XREAD count does not grow with clients
        assert stats["readers_started"] == 1
        assert stats["xreads"] < 60, stats
        assert stats["events_read"] == len(log) - 5  # the first five were read by each client's catch-up
        assert stats["clients_total"] == n and stats["clients_active"] == 0 and stats["feeds_active"] == 0
    finally:
        await cleanup(redis_client, key_prefix)


def _big_stream(rid: str) -> Attempt:
    """12 MB of text: more than the kernel's socket buffers can hide (send buffers grow to 4 MB)."""
    big = "x" * 32_000
    return Attempt(rid, 1).block("text", [big] * 384).done()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _stalled_client_socket(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connect: the window stays tiny
    s.connect(("127.0.0.1", port))
    return s


def _stalled_client(port: int, path: str) -> socket.socket:
    """A client that sends its request and then never reads: a tiny receive window fills at once."""
    s = _stalled_client_socket(port)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode())
    return s


def _drain(s: socket.socket, timeout: float) -> tuple[int, bool]:
    """Read what was buffered; (bytes, closed by the server)."""
    s.settimeout(timeout)
    total = 0
    try:
        while chunk := s.recv(1 << 20):
            total += len(chunk)
    except ConnectionResetError:
        return total, True
    except TimeoutError:
        return total, False
    return total, True


async def test_non_reading_client_is_cut_off_while_others_finish(redis_url, key_prefix, redis_client) -> None:
    a = _big_stream("slow")
    await publish(redis_client, key_prefix, "slow", 1, a.events[:1])
    records = _Records()
    logger = logging.getLogger("sluice.relay")
    logger.addHandler(records)
    try:
        config = config_for(redis_url, key_prefix, buffer=32)
        async with serve_relay(config) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "slow")
            stalled = _stalled_client(relay.port, "/v1/requests/slow/events")
            results: list[Received] = []
            reading = [Received(0) for _ in range(3)]

            async def reader(got: Received) -> None:
                results.append(await read_sse(client, url, headers=AUTH, into=got))

            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                for got in reading:
                    tg.start_soon(reader, got)
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == 4)
                # bursts of 8 events (well inside the 32-event buffer of a client that keeps reading), the
                # next once the readers have the last
                for i in range(1, len(a.events), 8):
                    await publish(redis_client, key_prefix, "slow", 1, a.events[i : i + 8])
                    sent = min(i + 8, len(a.events))
                    await wait_until(lambda sent=sent: all(len(g.contract) == sent for g in reading))
                await finalize(redis_client, key_prefix, "slow")
            elapsed = time.monotonic() - started
            stats = relay.hub.statistics()
            received, closed = await anyio.to_thread.run_sync(_drain, stalled, 5.0)
            stalled.close()
        log = await stored(redis_client, key_prefix, "slow")
        assert [r.contract == log and r.ended for r in results] == [True, True, True]
        assert elapsed < 10
        assert stats["clients_cut_slow"] == 1 and stats["clients_active"] == 0
        # the server dropped the stalled connection long before the stream's 12 MB reached it
        assert closed and received < 8_000_000
        cut = [r for r in records.records if r.getMessage().startswith("client cut off")]
        assert len(cut) == 1
        assert cut[0].request_id == "slow" and cut[0].reason == "32 events waiting unread"  # type: ignore[attr-defined]
    finally:
        logger.removeHandler(records)
        await cleanup(redis_client, key_prefix)


def _stalled_websocket(port: int, path: str) -> socket.socket:
    """A WebSocket client that completes the handshake and then never reads (a tiny receive window)."""
    s = _stalled_client_socket(port)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


async def test_non_reading_websocket_client_is_cut_off(redis_url, key_prefix, redis_client) -> None:
    a = _big_stream("wslow")
    await publish(redis_client, key_prefix, "wslow", 1, a.events[:1])
    try:
        async with serve_relay(config_for(redis_url, key_prefix, buffer=32)) as relay, httpx.AsyncClient() as client:
            stalled = await anyio.to_thread.run_sync(_stalled_websocket, relay.port, "/v1/requests/wslow/ws")
            results: list[Received] = []
            reading = Received(0)

            async def reader() -> None:
                results.append(await read_sse(client, events_url(relay.url, "wslow"), headers=AUTH, into=reading))

            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await wait_until(lambda: relay.hub.statistics()["clients_active"] == 2)
                for i in range(1, len(a.events), 8):  # the next burst once the reading client has the last
                    await publish(redis_client, key_prefix, "wslow", 1, a.events[i : i + 8])
                    sent = min(i + 8, len(a.events))
                    await wait_until(lambda sent=sent: len(reading.contract) == sent)
                await finalize(redis_client, key_prefix, "wslow")
            stats = relay.hub.statistics()
            received, closed = await anyio.to_thread.run_sync(_drain, stalled, 5.0)
            stalled.close()
            log = await stored(redis_client, key_prefix, "wslow")
        assert results[0].contract == log and results[0].ended
        assert stats["clients_cut_slow"] == 1
        assert closed and received < 8_000_000
    finally:
        await cleanup(redis_client, key_prefix)

"""The fault-injecting TCP proxy, against the real Redis (through redis-py asyncio) and a loopback echo server.

Every assertion is on outcomes, byte counts and order; timeouts only bound the waits, nothing asserts how
long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.faults import ProxyStatistics, TcpProxy

pytestmark = pytest.mark.asyncio

WAIT = 10.0  # bounds every wait so a broken proxy fails the test instead of hanging it


T = TypeVar("T")


def _client(url: str, **kwargs: Any) -> aioredis.Redis:
    # No client-side retries: redis-py >= 6 retries 3 times by default, which would hide each fault.
    return aioredis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kwargs)


async def _run(command: Awaitable[T]) -> T:
    """redis-py types its commands as Awaitable; a task needs a coroutine."""
    return await command


async def _until(proxy: TcpProxy, predicate: Callable[[ProxyStatistics], bool]) -> ProxyStatistics:
    async with asyncio.timeout(WAIT):
        return await proxy.wait_until(predicate)


@pytest_asyncio.fixture
async def direct(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client that bypasses the proxy, to check what really reached Redis."""
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


class Echo:
    """A loopback echo server recording every byte received and how each connection ended. On EOF it sends
    one more byte, b"!", and closes: the reply proves a half-close reached it in order and the other
    direction still worked."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self.endings: list[str] = []
        self.port = 0
        self._ended = asyncio.Condition()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        ending = "reset"
        try:
            while data := await reader.read(65536):
                self.received += data
                writer.write(data)
                await writer.drain()
            writer.write(b"!")
            await writer.drain()
            ending = "eof"
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            async with self._ended:
                self.endings.append(ending)
                self._ended.notify_all()

    async def wait_endings(self, n: int) -> None:
        async with asyncio.timeout(WAIT), self._ended:
            await self._ended.wait_for(lambda: len(self.endings) >= n)


@pytest_asyncio.fixture
async def echo() -> AsyncIterator[Echo]:
    server = Echo()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = int(srv.sockets[0].getsockname()[1])
    async with srv:
        yield server


@contextlib.asynccontextmanager
async def _raw(proxy: TcpProxy) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


# -- through Redis --


async def test_commands_go_through_the_proxy(redis_url: str, key_prefix: str, direct: aioredis.Redis) -> None:
    key = f"{key_prefix}:k"
    async with TcpProxy.for_url(redis_url) as proxy:
        r = _client(proxy.url_for(redis_url))
        try:
            assert await r.set(key, "v1") is True
            assert await r.get(key) == b"v1"
            stats = proxy.statistics()
            assert (stats.accepted, stats.open, stats.refused, stats.cut, stats.target_errors) == (1, 1, 0, 0, 0)
            assert stats.bytes_to_target > 0 and stats.bytes_to_client > 0
            assert stats.held_bytes == 0
        finally:
            await r.aclose()
        assert await direct.get(key) == b"v1"  # it really reached Redis
        stats = await _until(proxy, lambda s: s.open == 0)  # the client's close went through
    assert proxy.statistics().open == 0
    await direct.delete(key)


async def test_cut_fails_the_next_command_and_a_retry_reconnects(redis_url: str, key_prefix: str) -> None:
    key = f"{key_prefix}:k"
    async with TcpProxy.for_url(redis_url) as proxy:
        r = _client(proxy.url_for(redis_url))
        try:
            await r.set(key, "kept")
            assert proxy.cut() == 1
            stats = proxy.statistics()
            assert (stats.open, stats.cut) == (0, 1)
            with pytest.raises(RedisConnectionError):
                await r.get(key)
            assert await r.get(key) == b"kept"  # the retry opened a new connection through the proxy
            stats = proxy.statistics()
            assert (stats.accepted, stats.open, stats.cut) == (2, 1, 1)
            assert proxy.cut() == 1
            with pytest.raises(RedisConnectionError):
                await r.set(key, "never")  # cut before its bytes were forwarded: it never reached Redis
            assert await r.get(key) == b"kept"
            await r.delete(key)
        finally:
            await r.aclose()


async def test_stall_times_out_a_command_and_unstall_lets_the_next_through(redis_url: str, key_prefix: str) -> None:
    key = f"{key_prefix}:k"
    async with TcpProxy.for_url(redis_url) as proxy:
        r = _client(proxy.url_for(redis_url), socket_timeout=0.3)
        try:
            await r.set(key, "v")
            before = proxy.statistics()
            proxy.stall(True)
            with pytest.raises(RedisTimeoutError):
                await r.get(key)
            during = proxy.statistics()
            assert during.bytes_to_target == before.bytes_to_target  # the GET was read but held
            assert during.bytes_to_client == before.bytes_to_client
            assert during.held_bytes == len(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key.encode()))
            proxy.stall(False)
            assert await r.get(key) == b"v"  # redis-py dropped the timed-out connection: a new one
            # The held GET was delivered late on the old connection, as a healed partition does.
            after = await _until(proxy, lambda s: s.held_bytes == 0 and s.open == 1)
            assert after.accepted == 2
            assert after.bytes_to_target >= before.bytes_to_target + 2 * during.held_bytes
            await r.delete(key)
        finally:
            await r.aclose()


async def test_stall_holds_new_connections_until_lifted(redis_url: str) -> None:
    async with TcpProxy.for_url(redis_url) as proxy:
        proxy.stall(True)
        r = _client(proxy.url_for(redis_url), socket_timeout=0.3, socket_connect_timeout=0.3)
        try:
            with pytest.raises((RedisTimeoutError, RedisConnectionError)):  # the handshake never gets an answer
                await r.ping()
            assert proxy.statistics().bytes_to_target == 0
            proxy.stall(False)
            assert await r.ping() is True
        finally:
            await r.aclose()


async def test_refuse_fails_new_connections_until_lifted(redis_url: str, key_prefix: str) -> None:
    key = f"{key_prefix}:k"
    async with TcpProxy.for_url(redis_url) as proxy:
        url = proxy.url_for(redis_url)
        old, new = _client(url), _client(url)
        try:
            await old.set(key, "v")
            sent = proxy.statistics().bytes_to_target
            proxy.refuse(True)
            for _ in range(3):
                with pytest.raises(RedisConnectionError):
                    await new.ping()
            stats = proxy.statistics()
            assert (stats.accepted, stats.refused, stats.open) == (4, 3, 1)
            assert stats.bytes_to_target == sent
            assert await old.get(key) == b"v"  # an open connection is untouched by refusing
            proxy.cut()  # ...so refuse + cut is what a Redis restart looks like
            with pytest.raises(RedisConnectionError):
                await old.get(key)
            with pytest.raises(RedisConnectionError):
                await old.get(key)  # the reconnect is refused too
            proxy.refuse(False)
            assert await new.ping() is True
            assert await old.get(key) == b"v"
            await old.delete(key)
        finally:
            await old.aclose()
            await new.aclose()


_PAYLOAD = b"".join(i.to_bytes(4, "big") for i in range(64 * 1024))  # 256 KiB, any reordering shows


async def test_throttle_slows_a_large_read(redis_url: str, key_prefix: str, direct: aioredis.Redis) -> None:
    key = f"{key_prefix}:big"
    await direct.set(key, _PAYLOAD)
    async with TcpProxy.for_url(redis_url) as proxy:
        r = _client(proxy.url_for(redis_url))
        try:
            await r.ping()
            base = proxy.statistics().bytes_to_client
            proxy.throttle(64 * 1024)  # the whole value would take ~4 s
            seen: list[int] = []

            def quarter_arrived(s: ProxyStatistics) -> bool:
                seen.append(s.bytes_to_client - base)
                return seen[-1] >= len(_PAYLOAD) // 8

            async with asyncio.TaskGroup() as tg:
                get = tg.create_task(_run(r.get(key)))
                stats = await _until(proxy, quarter_arrived)
                # Part of the value has arrived and the command is still waiting for the rest...
                assert not get.done()
                assert stats.bytes_to_client - base < len(_PAYLOAD)
                # ...because it was forwarded in many small paced pieces (rate / 20 bytes), each one seen here.
                steps = [b - a for a, b in itertools.pairwise(sorted(set(seen))) if b > a]
                assert len(steps) >= len(_PAYLOAD) // 8 // (64 * 1024 // 20)
                assert max(steps) <= 64 * 1024 // 20
                proxy.throttle(None)
            assert get.result() == _PAYLOAD
            assert proxy.statistics().bytes_to_client - base > len(_PAYLOAD)
        finally:
            await r.aclose()
            await direct.delete(key)


async def test_throttle_slows_a_large_write_with_back_pressure(
    redis_url: str, key_prefix: str, direct: aioredis.Redis
) -> None:
    key = f"{key_prefix}:big"
    async with TcpProxy.for_url(redis_url) as proxy:
        r = _client(proxy.url_for(redis_url))
        try:
            await r.ping()
            base = proxy.statistics().bytes_to_target
            proxy.throttle(64 * 1024)
            async with asyncio.TaskGroup() as tg:
                put = tg.create_task(_run(r.set(key, _PAYLOAD)))
                stats = await _until(proxy, lambda s: s.bytes_to_target - base >= 32 * 1024)
                assert not put.done()
                assert stats.bytes_to_target - base < len(_PAYLOAD)
                assert await direct.exists(key) == 0  # Redis has not got the whole command yet
                # The proxy holds at most one read (64 KiB), not the payload: the rest waits in socket buffers.
                assert stats.held_bytes <= 64 * 1024
                proxy.throttle(None)
            assert put.result() is True
            assert await direct.get(key) == _PAYLOAD
        finally:
            await r.aclose()
            await direct.delete(key)


# -- raw TCP, against the echo server --


async def test_half_close_is_forwarded_in_order(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy, _raw(proxy) as (reader, writer):
        writer.write(b"hello ")
        writer.write(b"world")
        writer.write_eof()
        async with asyncio.timeout(WAIT):
            assert await reader.read() == b"hello world!"
        await echo.wait_endings(1)
        assert echo.endings == ["eof"]
        stats = await _until(proxy, lambda s: s.open == 0)
        assert (stats.bytes_to_target, stats.bytes_to_client) == (11, 12)


async def test_cut_resets_both_sides(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy, _raw(proxy) as (reader, writer):
        writer.write(b"ping")
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(4) == b"ping"
        assert proxy.cut() == 1
        async with asyncio.timeout(WAIT):
            with pytest.raises(ConnectionResetError):  # RST, not a clean EOF
                await reader.read(10)
        await echo.wait_endings(1)
        assert echo.endings == ["reset"]
        assert proxy.cut() == 0


async def test_stall_holds_bytes_and_eof_then_delivers_them_in_order(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy, _raw(proxy) as (reader, writer):
        writer.write(b"a")
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(1) == b"a"
        proxy.stall(True)
        writer.write(b"hello ")
        writer.write(b"world")
        writer.write_eof()
        await _until(proxy, lambda s: s.held_bytes > 0)
        assert bytes(echo.received) == b"a"
        stats = proxy.statistics()
        assert (stats.bytes_to_target, stats.bytes_to_client, stats.open) == (1, 1, 1)
        proxy.stall(False)
        async with asyncio.timeout(WAIT):
            assert await reader.read() == b"hello world!"
        assert bytes(echo.received) == b"ahello world"


async def test_stall_holds_a_half_close(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy, _raw(proxy) as (reader, writer):
        writer.write(b"a")
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(1) == b"a"
        proxy.stall(True)
        writer.write_eof()
        await _until(proxy, lambda s: s.held_eofs == 1)
        assert echo.endings == []  # the echo server has not seen the EOF
        proxy.stall(False)
        async with asyncio.timeout(WAIT):
            assert await reader.read() == b"!"
        await echo.wait_endings(1)
        assert echo.endings == ["eof"]
        assert proxy.statistics().held_eofs == 0


async def test_cut_while_stalled_drops_the_held_bytes(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy, _raw(proxy) as (reader, writer):
        writer.write(b"a")
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(1) == b"a"
        proxy.stall(True)
        writer.write(b"lost")
        await _until(proxy, lambda s: s.held_bytes == 4)
        assert proxy.cut() == 1
        stats = await _until(proxy, lambda s: s.held_bytes == 0)
        proxy.stall(False)
        await echo.wait_endings(1)
        assert echo.endings == ["reset"]
        assert bytes(echo.received) == b"a"
        assert stats.bytes_to_target == 1


async def test_stall_does_not_dial_new_connections(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy:
        proxy.stall(True)
        async with _raw(proxy) as (reader, writer):
            writer.write(b"x")
            stats = await _until(proxy, lambda s: s.accepted == 1)
            assert stats.open == 1
            assert echo.connections == 0
            proxy.stall(False)
            async with asyncio.timeout(WAIT):
                assert await reader.readexactly(1) == b"x"
            assert echo.connections == 1


async def test_refused_connections_are_reset_before_dialling(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy:
        proxy.refuse(True)
        async with _raw(proxy) as (reader, writer):
            writer.write(b"x")
            async with asyncio.timeout(WAIT):
                with pytest.raises(ConnectionResetError):
                    await reader.read(10)
        stats = proxy.statistics()
        assert (stats.accepted, stats.refused, stats.open, stats.bytes_to_target) == (1, 1, 0, 0)
        assert echo.connections == 0
        proxy.refuse(False)
        async with _raw(proxy) as (reader, writer):
            writer.write(b"y")
            async with asyncio.timeout(WAIT):
                assert await reader.readexactly(1) == b"y"


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_target_resets_the_client() -> None:
    async with TcpProxy("127.0.0.1", _unused_port()) as proxy, _raw(proxy) as (reader, _):
        async with asyncio.timeout(WAIT):
            with pytest.raises(ConnectionResetError):
                await reader.read(10)
        stats = await _until(proxy, lambda s: s.open == 0)
        assert (stats.accepted, stats.target_errors) == (1, 1)


async def test_leaving_the_context_resets_open_connections(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy, _raw(proxy) as (reader, writer):
        proxy.stall(True)  # a pump waiting on a stall must not keep the proxy from closing
        writer.write(b"x")
        await _until(proxy, lambda s: s.held_bytes == 1)
        await proxy.aclose()
        async with asyncio.timeout(WAIT):
            with pytest.raises(ConnectionResetError):
                await reader.read(10)
        assert proxy.statistics().open == 0

"""A TCP proxy on loopback that can cut, refuse, stall or throttle the connections it carries.

Rule: the proxy moves bytes in order and never invents, drops or reorders them except as a stated fault;
every fault is one a real network or a restarted Redis produces:

- ``cut()``: every open connection is reset on both sides at once (SO_LINGER 0, so each peer sees
  ECONNRESET, not a clean EOF): a Redis crash or a dropped NAT entry. Bytes read but not yet forwarded
  are discarded.
- ``refuse(True)``: new connections are accepted and reset at once, before the target is dialled and
  before any byte moves. The listening socket stays open so the port (and the worker's configured URL)
  never changes; closing it would give a true ECONNREFUSED, but the port could be taken meanwhile. To
  redis-py both are ``redis.exceptions.ConnectionError``. Open connections are untouched:
  ``refuse(True)`` then ``cut()`` looks like a Redis restart, ``refuse(False)`` like it is back.
- ``stall(True)``: nothing moves in either direction, EOFs included, and new connections are accepted but
  not dialled through; every socket stays open: a frozen Redis (SIGSTOP) or a network partition. Bytes
  already read are held and delivered in order by ``stall(False)``, as TCP retransmission does when a
  partition heals, so a command that timed out on the client may still run on the server later;
  ``cut()`` while stalled drops them instead.
- ``throttle(n)``: each direction of each connection forwards at most ``n`` bytes per second (an upper
  bound: pieces of about n/20 bytes, each followed by its share of the second); ``throttle(None)`` lifts it.

Back-pressure is kept: a pump reads one piece, waits until it may forward it, and reads again only after
the write drained. A stalled or slow proxy therefore fills the sender's socket buffers and blocks its
writes, as a slow Redis does; per direction the proxy holds at most one piece plus its StreamReader
buffer (which stops reading the socket above ``2 * _PIECE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit, urlunsplit

__all__ = ["ProxyStatistics", "TcpProxy"]

_PIECE = 64 * 1024  # largest read per pump step, and the StreamReader limit
_PIECES_PER_SECOND = 20  # throttled pieces are rate/20 bytes, so progress stays smooth
_TO_TARGET, _TO_CLIENT = 0, 1
_REDIS_SCHEMES = ("redis", "rediss")


@dataclass(frozen=True, slots=True)
class ProxyStatistics:
    """A snapshot of the proxy's counters."""

    accepted: int  # client connections accepted, refused ones included
    refused: int  # of those, reset at once because the proxy was refusing
    open: int  # connections carried now (accepted, not refused, not yet closed or cut)
    cut: int  # connections reset by cut()
    target_errors: int  # dials to the target that failed (the client was then reset)
    bytes_to_target: int  # client -> target bytes forwarded
    bytes_to_client: int  # target -> client bytes forwarded
    held_bytes: int  # bytes read from one side and not yet forwarded (waiting on a stall or the throttle)
    held_eofs: int  # half-closes read from one side and not yet forwarded (waiting on a stall)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close now with RST: a zero SO_LINGER makes close() drop unsent data and send a reset (socket(7))."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed by the peer's reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """One client connection and the target connection dialled for it."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.writers = [client]
        self.closed = False
        self.next_at = [0.0, 0.0]  # per direction: loop time before which the throttle holds the next piece

    def reset(self) -> None:
        self.closed = True
        for writer in self.writers:
            _reset(writer)

    def close(self) -> None:
        self.closed = True
        for writer in self.writers:
            if not writer.is_closing():
                writer.close()


class TcpProxy:
    """``async with TcpProxy(host, port) as proxy:`` forwards 127.0.0.1:``proxy.port`` to ``host:port``.

    Runs on the caller's event loop. The fault switches (``cut``, ``refuse``, ``stall``, ``throttle``) are
    plain methods, callable from any task and effective at once."""

    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False
        self._refusing = False
        self._stalled = False
        self._rate: float | None = None
        self._settings = asyncio.Event()  # replaced after each set: wakes pumps when a switch changes
        self._progress = asyncio.Event()  # replaced after each set: wakes wait_until() on any counter change
        self._accepted = self._refused = self._cut = self._target_errors = 0
        self._bytes = [0, 0]
        self._held = self._held_eofs = 0

    @classmethod
    def for_url(cls, redis_url: str) -> TcpProxy:
        """A proxy in front of the Redis server a ``redis://`` / ``rediss://`` URL names."""
        parts = urlsplit(redis_url)
        if parts.scheme not in _REDIS_SCHEMES or not parts.hostname:
            raise ValueError(f"not a TCP Redis URL: {redis_url!r}")
        return cls(parts.hostname, parts.port or 6379)

    def __repr__(self) -> str:
        return f"TcpProxy({self.host}:{self.port} -> {self.target_host}:{self.target_port})"

    def url_for(self, redis_url: str) -> str:
        """The same Redis URL (scheme, credentials, database, query) with the proxy as host and port."""
        if not self.port:
            raise RuntimeError("the proxy's port is chosen when it starts: call url_for inside `async with`")
        parts = urlsplit(redis_url)
        if parts.scheme not in _REDIS_SCHEMES or not parts.hostname:
            raise ValueError(f"not a TCP Redis URL: {redis_url!r}")
        userinfo, at, _ = parts.netloc.rpartition("@")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}:{self.port}"))

    # -- lifecycle --

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=_PIECE)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        """Stop listening and reset every connection. Handlers are not cancelled: every socket is aborted,
        so each pump sees EOF or an error and returns on its own."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        self._poke_settings()
        if self._handlers:
            _, pending = await asyncio.wait(set(self._handlers), timeout=5)
            for task in pending:  # pragma: no cover - a dial to an unresponsive target
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    # -- fault switches --

    def cut(self) -> int:
        """Reset every open connection on both sides now; returns how many. New connections still work
        (unless refusing). The sockets close on the loop's next iteration: nothing a peer sends after this
        call is forwarded, and its next read fails with ECONNRESET."""
        links = [link for link in self._links if not link.closed]
        for link in self._links:  # closing ones too, so a graceful close blocked on a full buffer ends
            link.reset()
        self._cut += len(links)
        self._poke_settings()
        self._poke_progress()
        return len(links)

    def refuse(self, on: bool = True) -> None:
        """While on, new connections are accepted and reset at once (see the module docstring)."""
        self._refusing = on

    def stall(self, on: bool = True) -> None:
        """While on, no byte or EOF moves in either direction and no new connection reaches the target."""
        self._stalled = on
        self._poke_settings()

    def throttle(self, bytes_per_second: float | None) -> None:
        """Forward at most this many bytes per second in each direction of each connection; None lifts it."""
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("the rate must be positive (use stall() to stop traffic)")
        self._rate = bytes_per_second
        for link in self._links:  # a new rate applies from the next piece, not after the old rate's wait
            link.next_at = [0.0, 0.0]
        self._poke_settings()

    # -- observation --

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(
            accepted=self._accepted,
            refused=self._refused,
            open=sum(not link.closed for link in self._links),
            cut=self._cut,
            target_errors=self._target_errors,
            bytes_to_target=self._bytes[_TO_TARGET],
            bytes_to_client=self._bytes[_TO_CLIENT],
            held_bytes=self._held,
            held_eofs=self._held_eofs,
        )

    async def wait_until(self, predicate: Callable[[ProxyStatistics], bool]) -> ProxyStatistics:
        """Wait until the statistics satisfy ``predicate`` (re-checked on every change); returns them.
        Has no deadline of its own: bound it with ``asyncio.timeout``."""
        while True:
            changed = self._progress
            if predicate(stats := self.statistics()):
                return stats
            await changed.wait()

    # -- internals --

    def _poke_settings(self) -> None:
        self._settings.set()
        self._settings = asyncio.Event()

    def _poke_progress(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def _wait_settings(self, until: float | None) -> None:
        """Wait until a switch changes or the loop time ``until`` passes."""
        changed = self._settings
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(until):
                await changed.wait()

    async def _wait_turn(self, link: _Link, direction: int, size: int) -> bool:
        """Wait until ``size`` bytes (0: an EOF or the dial) may go in ``direction``; False if the link
        was closed meanwhile."""
        loop = asyncio.get_running_loop()
        while not link.closed:
            if self._stalled:
                await self._wait_settings(None)
                continue
            if self._rate is None or size == 0:
                return True
            now = loop.time()
            if link.next_at[direction] <= now:
                link.next_at[direction] = now + size / self._rate
                return True
            await self._wait_settings(link.next_at[direction])
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted += 1
        if self._closing or self._refusing:
            if self._refusing:
                self._refused += 1
            _reset(writer)
            self._poke_progress()
            return
        task = asyncio.current_task()
        assert task is not None
        link = _Link(writer)
        self._handlers.add(task)
        self._links.add(link)
        self._poke_progress()
        try:
            await self._carry(link, reader)
        finally:
            link.close()
            for w in link.writers:
                with contextlib.suppress(ConnectionError, OSError):  # closed by a reset
                    await w.wait_closed()
            self._links.discard(link)
            self._handlers.discard(task)
            self._poke_progress()

    async def _carry(self, link: _Link, client_reader: asyncio.StreamReader) -> None:
        if not await self._wait_turn(link, _TO_TARGET, 0):  # a partition stops the dial too
            return
        try:
            target_reader, target_writer = await asyncio.open_connection(
                self.target_host, self.target_port, limit=_PIECE
            )
        except OSError:
            self._target_errors += 1
            link.reset()
            return
        link.writers.append(target_writer)
        if link.closed:  # cut while dialling
            link.reset()
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump(link, client_reader, target_writer, _TO_TARGET))
            tg.create_task(self._pump(link, target_reader, link.writers[0], _TO_CLIENT))

    def _piece_size(self) -> int:
        rate = self._rate
        return _PIECE if rate is None else max(1, min(_PIECE, int(rate) // _PIECES_PER_SECOND))

    async def _pump(self, link: _Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: int) -> None:
        """Forward one direction until EOF (passed on as a half-close) or a reset (passed on as a reset of
        both sides, as the peer would see it)."""
        try:
            while not link.closed:
                data = await src.read(self._piece_size())
                if not data:
                    self._held_eofs += 1
                    self._poke_progress()
                    try:
                        if await self._wait_turn(link, direction, 0) and dst.can_write_eof():
                            dst.write_eof()
                    finally:
                        self._held_eofs -= 1
                    return
                self._held += len(data)
                self._poke_progress()
                try:
                    # Sliced again at send time: a read started before throttle() may return a whole _PIECE.
                    while data:
                        piece = data[: self._piece_size()]
                        if not await self._wait_turn(link, direction, len(piece)):
                            return
                        dst.write(piece)
                        data = data[len(piece) :]
                        self._held -= len(piece)
                        self._bytes[direction] += len(piece)
                        self._poke_progress()
                        await dst.drain()
                finally:
                    self._held -= len(data)  # what a cut or a reset left unsent
        except (ConnectionError, OSError):
            link.reset()

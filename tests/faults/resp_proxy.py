"""A TCP proxy in front of Redis that reads RESP, so a test can lose exactly one command or one reply.

Rule: bytes move in order and unchanged; the proxy only finds where each command (client to server) and
each reply (server to client) ends, pairs them per connection (Redis answers in order), and records every
command. One armed fault acts once, on the n-th command a test's classifier gives a label:

- ``lose_reply``: Redis runs the command, then its reply is dropped and the connection reset on both
  sides (SO_LINGER 0): the client cannot tell whether it ran. A reply predicate may restrict this to
  replies of interest (an XREADGROUP that carried a job, not one that timed out empty).
- ``drop_command``: the connection is reset before the command reaches Redis: it never ran.

Other commands pipelined on the same connection lose their replies too, as with any real reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Command", "Fault", "RespFaultProxy", "resp_end"]

Classifier = Callable[[list[bytes]], str | None]


def resp_end(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """The offset just past the RESP2 value starting at ``pos``, or None when it is not complete yet."""
    if pos >= len(buf):
        return None
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind = buf[pos : pos + 1]
    if kind in (b"+", b"-", b":"):
        return line_end + 2
    if kind == b"$":
        n = int(buf[pos + 1 : line_end])
        if n < 0:
            return line_end + 2
        end = line_end + 2 + n + 2
        return end if end <= len(buf) else None
    if kind == b"*":
        n = int(buf[pos + 1 : line_end])
        p: int | None = line_end + 2
        for _ in range(max(n, 0)):
            assert p is not None
            p = resp_end(buf, p)
            if p is None:
                return None
        return p
    return line_end + 2  # an inline command


def _command_args(raw: bytes) -> list[bytes]:
    """A client command's arguments (an array of bulk strings, or an inline command)."""
    if not raw.startswith(b"*"):
        return raw.strip().split()
    args: list[bytes] = []
    pos = raw.find(b"\r\n") + 2
    while pos < len(raw):
        line_end = raw.find(b"\r\n", pos)
        n = int(raw[pos + 1 : line_end])
        args.append(raw[line_end + 2 : line_end + 2 + n])
        pos = line_end + 2 + n + 2
    return args


@dataclass(slots=True)
class Command:
    conn: int
    args: list[bytes]
    label: str | None
    reply: bytes | None = None  # set when its reply passed (or was lost: then stays None)


@dataclass(slots=True)
class Fault:
    label: str
    nth: int  # 1-based occurrence of the label, counted from when the fault was armed
    mode: Literal["lose_reply", "drop_command"]
    reply_matches: Callable[[bytes], bool] | None = None  # lose_reply: only a reply like this counts
    seen: int = 0
    fired: bool = False
    fired_on: Command | None = None


@dataclass(slots=True, eq=False)
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    pending: list[Command] = field(default_factory=list)
    dead: bool = False


def _reset(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    with contextlib.suppress(OSError):
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class RespFaultProxy:
    def __init__(self, target_host: str, target_port: int, classify: Classifier) -> None:
        self.target = (target_host, target_port)
        self.classify = classify
        self.commands: list[Command] = []
        self.fault: Fault | None = None
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._conns = 0
        self.port = 0

    @classmethod
    def for_url(cls, redis_url: str, classify: Classifier) -> RespFaultProxy:
        parts = urlsplit(redis_url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 6379, classify)

    def url_for(self, redis_url: str) -> str:
        parts = urlsplit(redis_url)
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, f"{netloc[0]}@{host}" if len(netloc) == 2 else host, parts.path, "", ""))

    async def __aenter__(self) -> RespFaultProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for link in list(self._links):
            _reset(link.client)
            _reset(link.server)
        with contextlib.suppress(Exception):
            await self._server.wait_closed()

    def arm(self, fault: Fault | None) -> None:
        self.fault = fault

    def labelled(self, since: int = 0) -> list[Command]:
        return [c for c in self.commands[since:] if c.label is not None]

    def _kill(self, link: _Link) -> None:
        link.dead = True
        _reset(link.client)
        _reset(link.server)

    async def _flush_then_kill(self, link: _Link, writer: asyncio.StreamWriter | None, data: bytearray) -> None:
        if data and writer is not None:
            writer.write(bytes(data))
            with contextlib.suppress(ConnectionError, OSError):
                await writer.drain()
            await asyncio.sleep(0.01)  # let the kernel hand them over before the reset discards its buffers
        self._kill(link)

    def _fires_on_command(self, cmd: Command) -> bool:
        return self._fires("drop_command", cmd, None)

    def _fires_on_reply(self, cmd: Command, reply: bytes) -> bool:
        return self._fires("lose_reply", cmd, reply)

    def _fires(self, mode: str, cmd: Command, reply: bytes | None) -> bool:
        """Whether the armed fault acts on this command (its n-th matching occurrence), once."""
        f = self.fault
        if f is None or f.fired or f.mode != mode or cmd.label != f.label:
            return False
        if reply is not None and f.reply_matches is not None and not f.reply_matches(reply):
            return False
        f.seen += 1
        if f.seen == f.nth:
            f.fired, f.fired_on = True, cmd
            return True
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(writer)
        self._links.add(link)
        self._conns += 1
        conn = self._conns
        try:
            sreader, swriter = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            self._links.discard(link)
            return
        link.server = swriter
        try:
            await asyncio.gather(self._to_server(link, conn, reader), self._to_client(link, sreader))
        finally:
            self._links.discard(link)
            if not link.dead:
                for w in (link.client, link.server):
                    if w is not None:
                        w.close()

    async def _to_server(self, link: _Link, conn: int, reader: asyncio.StreamReader) -> None:
        def command(raw: bytes) -> bool:
            args = _command_args(raw)
            cmd = Command(conn, args, self.classify(args))
            self.commands.append(cmd)
            if self._fires_on_command(cmd):
                return True
            link.pending.append(cmd)
            return False

        async def eof() -> None:
            if link.server is not None and not link.dead:
                with contextlib.suppress(OSError, RuntimeError):
                    link.server.write_eof()

        await self._pump(link, reader, link.server, command, eof)  # what came before a dropped one reaches Redis

    async def _to_client(self, link: _Link, reader: asyncio.StreamReader) -> None:
        def reply(raw: bytes) -> bool:
            cmd = link.pending.pop(0) if link.pending else None
            if cmd is None:
                return False
            if self._fires_on_reply(cmd, raw):
                return True
            cmd.reply = raw
            return False

        async def eof() -> None:
            if not link.dead:
                self._kill(link)  # Redis went away: the client sees a reset, as with a real crash

        await self._pump(link, reader, link.client, reply, eof)  # replies before a lost one are delivered

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
        each: Callable[[bytes], bool],
        eof: Callable[[], Awaitable[None]],
    ) -> None:
        """Forward whole RESP values in order; ``each`` sees every value and says when the fault fires (what
        came before it in this read is delivered, then the link is reset)."""
        buf = bytearray()
        while not link.dead:
            try:
                data = await reader.read(65536)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                await eof()
                return
            buf += data
            out = bytearray()
            while (end := resp_end(buf)) is not None:
                value = bytes(buf[:end])
                del buf[:end]
                if each(value):
                    await self._flush_then_kill(link, writer, out)
                    return
                out += value
            if out and writer is not None:
                writer.write(bytes(out))
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.drain()

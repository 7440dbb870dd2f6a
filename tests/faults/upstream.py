"""A misbehaving upstream of the tests' own (not the fake provider): a raw HTTP/1.1 server on loopback
whose every response is scripted by the test, byte for byte.

Rule: a ``Reply`` is the status, headers and body the test wants, sent as a close-delimited body (no
chunking, no length) so a cut is a cut; ``cut_at`` resets the connection (SO_LINGER 0) once that many
body bytes went out, ``pace`` sleeps between the body's pieces. ``respond`` picks the reply for each
request from the request itself (its headers, so a test can echo the API key it received) and the
number of requests seen so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Received", "Reply", "ScriptedUpstream"]


@dataclass(slots=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(slots=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    pieces: Sequence[bytes] = ()
    cut_at: int | None = None  # body bytes sent before a reset; None: all of it, then a clean close
    pace: float = 0.0  # seconds between pieces


class ScriptedUpstream:
    def __init__(self, respond: Callable[[Received, int], Reply]) -> None:
        self.respond = respond
        self.received: list[Received] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ScriptedUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
        req = Received(method, path, headers, body)
        self.received.append(req)
        reply = self.respond(req, len(self.received))
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 429: "Too Many Requests"}.get(reply.status, "X")
        out = f"HTTP/1.1 {reply.status} {reason}\r\n"
        out += "".join(f"{k}: {v}\r\n" for k, v in {**reply.headers, "connection": "close"}.items()) + "\r\n"
        try:
            writer.write(out.encode("latin-1"))
            sent = 0
            for piece in reply.pieces:
                if reply.cut_at is not None and sent + len(piece) >= reply.cut_at:
                    writer.write(piece[: reply.cut_at - sent])
                    await writer.drain()
                    await asyncio.sleep(0.02)  # delivered before the reset discards the kernel's buffer
                    _reset(writer)
                    return
                writer.write(piece)
                sent += len(piece)
                await writer.drain()
                if reply.pace:
                    await asyncio.sleep(reply.pace)
            if reply.cut_at is not None and sent >= reply.cut_at:
                _reset(writer)
                return
            writer.close()
        except (ConnectionError, OSError):
            writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()

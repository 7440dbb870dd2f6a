"""The admin endpoint's HTTP/1.1 server, on the worker's event loop: h11 parses, a WSGI app answers.

Rule: the loop serves the probes and the scrapes itself. A server thread took the GIL back from the busy
loop at each of its system calls: under load one ``/healthz`` cost about 2 ms of CPU that way against
0.3 ms alone, a scrape's rendering as much again, and the loop paid for the hand-offs too
(docs/benchmarks.md, "The endpoint on the loop"). On the loop a request runs between two callbacks: a
scrape holds the loop for its rendering (about 1 ms), less than the GIL's 5 ms switch interval let a
thread hold it; and an answer proves the loop runs, which is what liveness asks.

Bounds, so no client holds more than a task: a request line and headers of ``_MAX_HEAD`` bytes at most
(431 past it), no request body read (a method other than GET or HEAD is answered and the connection
closed), ``_IDLE_S`` for a request to arrive (a silent client is dropped), ``_MAX_CONNECTIONS`` at once
(more are closed at accept). Connections are kept alive between requests, as Prometheus keeps them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import h11
from anyio.abc import Listener, SocketStream

__all__ = ["WSGIApp", "serve"]

log = logging.getLogger("sluice.worker")

# The WSGI app the server calls: (environ, start_response) -> body chunks.
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

_MAX_HEAD = 16 * 1024
_IDLE_S = 10.0
_MAX_CONNECTIONS = 64
_READ = 64 * 1024
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


async def serve(listener: Listener[SocketStream], app: WSGIApp) -> None:
    """Serve ``listener`` with ``app`` until cancelled."""
    open_now = 0

    async def connection(stream: SocketStream) -> None:
        nonlocal open_now
        async with stream:
            if open_now >= _MAX_CONNECTIONS:
                return
            open_now += 1
            try:
                await _serve_connection(stream, app)
            except Exception as exc:  # a bug answering one request never takes the worker down
                log.warning("admin endpoint request failed", extra={"error": type(exc).__name__})
            finally:
                open_now -= 1

    await listener.serve(connection)


async def _serve_connection(stream: SocketStream, app: WSGIApp) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
    while True:
        request = None
        with anyio.move_on_after(_IDLE_S):
            request = await _next_request(stream, conn)
        if request is None:
            return
        if not await _respond(stream, conn, request, app):
            return
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return
        conn.start_next_cycle()


async def _next_request(stream: SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The next whole request (GET and HEAD: their end read too); None when the client is gone or sent a
    malformed one (answered 400 or 431)."""
    request = None
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            await _send_error(stream, conn, status, "request header too large" if status == 431 else "bad request")
            return None
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive(_READ)
            except _GONE:
                data = b""
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
            # h11 bounds a head still arriving; one that came whole in a read is measured here.
            if len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers) > _MAX_HEAD:
                await _send_error(stream, conn, 431, "request header too large")
                return None
            if request.method not in (b"GET", b"HEAD"):
                return request  # answered 405 and closed: its body is never read
        elif isinstance(event, h11.EndOfMessage) and request is not None:
            return request
        elif isinstance(event, h11.Data):
            continue  # a GET with a body: ignored
        else:  # ConnectionClosed, PAUSED
            return None


async def _respond(stream: SocketStream, conn: h11.Connection, request: h11.Request, app: WSGIApp) -> bool:
    """Answer ``request`` with ``app``; False when the connection is to be closed."""
    path, _, query = request.target.decode("latin-1").partition("?")
    method = request.method.decode("ascii", "replace")
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}
    for name, value in request.headers:
        environ["HTTP_" + name.decode("latin-1").upper().replace("-", "_")] = value.decode("latin-1")
    got: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        got[:] = [status, headers]
        return lambda _data: None

    body = b"".join(app(environ, start_response))
    status, headers = got
    code, _, reason = status.partition(" ")
    keep = method in ("GET", "HEAD")
    sent = await _send(stream, conn, int(code), reason, headers, body, keep=keep, head_only=method == "HEAD")
    return sent and keep


async def _send_error(stream: SocketStream, conn: h11.Connection, status: int, text: str) -> None:
    headers = [("Content-Type", "text/plain; charset=utf-8")]
    with contextlib.suppress(h11.LocalProtocolError):  # the state allows no response: closing is the answer
        await _send(stream, conn, status, "", headers, f"{text}\n".encode(), keep=False, head_only=False)


async def _send(
    stream: SocketStream,
    conn: h11.Connection,
    status: int,
    reason: str,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    keep: bool,
    head_only: bool,
) -> bool:
    """One response (its length set here, ``Connection: close`` unless ``keep``); False when the client is
    gone before it was sent."""
    out = [(k, v) for k, v in headers if k.lower() not in ("content-length", "connection")]
    out.append(("Content-Length", str(len(body))))
    if not keep:
        out.append(("Connection", "close"))
    try:
        await stream.send(conn.send(h11.Response(status_code=status, headers=out, reason=reason)))
        if not head_only:
            await stream.send(conn.send(h11.Data(data=body)))
        await stream.send(conn.send(h11.EndOfMessage()))
    except _GONE:
        return False
    return True

"""The relay's HTTP surface: one request's normalized stream as Server-Sent Events or WebSocket messages.

Rule: every stream endpoint checks the token before anything else (401 without one, 403 with one that
does not grant this request) and serves no data otherwise. Each event goes out as it is stored: SSE
``id:`` its position ``<attempt>-<seq>``, ``event:`` its contract type, ``data:`` its contract JSON
(WebSocket: one text message ``{"id", "event", "data"}``); a client resumes from ``Last-Event-ID`` (it
wins over ``?after=``, since a browser sends it on every reconnect) and gets exactly the events after that
position. After the final attempt's terminal event the relay sends ``event: end`` and closes; a client
resuming at or after that position gets ``204 No Content``, which tells EventSource not to reconnect.
Heartbeat comments keep idle connections (and proxies) open. ``?coalesce_ms=N`` asks for the UI
projection of ``sluice.relay.coalesce``; without it events are forwarded one to one.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import msgspec
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from sluice.schemas.keys import Keys
from sluice.worker.cluster import AnyRedis, connect

from .auth import AuthError, Grant, RelayAuth
from .coalesce import Coalescer, Frame, frame_of
from .hub import Hub, HubClosed, Subscription
from .positions import Position, PositionError, parse_position

__all__ = ["Relay", "RelayConfig", "create_app", "sse_frame", "ws_message"]

log = logging.getLogger("sluice.relay")

STATIC = Path(__file__).resolve().parent / "static"
# Set in the request's own task when the relay cut the client off on purpose (see server.QuietCutOff).
CUT_OFF: ContextVar[bool] = ContextVar("sluice_relay_cut_off", default=False)
_ENC = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class RelayConfig:
    redis_url: str
    secrets: tuple[str, ...]
    key_prefix: str = "sluice"
    heartbeat: float = 15.0  # seconds between heartbeats on an idle stream
    buffer: int = 1000  # events a client may have waiting before it is cut off
    retry_ms: int = 1000  # the reconnection delay sent to EventSource
    block_ms: int = 1000  # XREAD block of a request's reader
    page: int = 500  # entries per XREAD / catch-up XRANGE call
    max_coalesce_ms: int = 5000
    # Each request being followed holds one connection in a blocking XREAD; catch-ups share the rest.
    redis_max_connections: int = 1024
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster (each reader reads one slot's key)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def sse_frame(frame: Frame) -> bytes:
    """One SSE event; a (never expected) line break in the JSON is split over ``data:`` lines."""
    lines = frame.data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    head = b"id: %s\nevent: %s\n" % (str(frame.position).encode(), frame.type.encode())
    return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


def ws_message(frame: Frame) -> str:
    """One WebSocket text message: ``{"id": position, "event": type, "data": contract JSON}``."""
    return f'{{"id":"{frame.position}","event":"{frame.type}","data":{frame.data.decode()}}}'


def _end_payload(final: Position | None) -> bytes:
    return _ENC.encode({"final": str(final) if final is not None else None})


async def _frames(sub: Subscription, window: float, heartbeat: float) -> AsyncGenerator[list[Frame], None]:
    """Batches of frames as they become due; an empty batch means a heartbeat is due."""
    coalescer = Coalescer(window) if window > 0 else None
    next_beat = anyio.current_time() + heartbeat
    while True:
        wake = next_beat
        if coalescer is not None and (deadline := coalescer.deadline()) is not None:
            wake = min(wake, deadline)
        batch = await sub.next_batch(max(0.0, wake - anyio.current_time()))
        now = anyio.current_time()
        if coalescer is None:
            frames = [frame_of(e) for e in batch]
        else:
            frames = [f for e in batch for f in coalescer.push(e, now)] + coalescer.due(now)
        done = sub.finished
        if done and coalescer is not None:
            frames += coalescer.flush()
        if frames or now >= next_beat:
            yield frames
            next_beat = now + heartbeat
        if done:
            return


class Relay:
    """The endpoints' shared state: config, auth and (while the app runs) the hub."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.auth = RelayAuth(config.secrets)
        self.hub: Hub | None = None
        # Set by the server that runs the app (``server.RelayServer``): drops a connection at once,
        # buffered bytes and all. ASGI has no abort; without it a cut-off client's connection is closed
        # only after the server flushed what it had buffered.
        self.abort: Callable[[Scope], bool] | None = None
        self._page = (STATIC / "index.html").read_bytes()
        self._page_headers = _page_headers(self._page)

    def abort_connection(self, scope: Scope) -> bool:
        return self.abort(scope) if self.abort is not None else False

    def _hub(self) -> Hub:
        if self.hub is None or self.hub.closing:
            raise _BadRequest(503, "the relay is shutting down")
        return self.hub

    def _grant(self, conn: HTTPConnection, request_id: str) -> Grant:
        header = conn.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else conn.query_params.get("token")
        return self.auth.check(token, request_id, time.time())

    async def _open(self, conn: HTTPConnection) -> tuple[str, Grant, Position, float, Hub]:
        """Check everything a stream needs before any data. Raises ``AuthError`` or ``_BadRequest``."""
        request_id = conn.path_params["request_id"]
        grant = self._grant(conn, request_id)
        try:
            after = parse_position(conn.headers.get("last-event-id") or conn.query_params.get("after"))
        except PositionError as exc:
            raise _BadRequest(400, str(exc)) from None
        raw = conn.query_params.get("coalesce_ms", "0")
        if not raw.isdigit() or int(raw) > self.config.max_coalesce_ms:
            raise _BadRequest(400, f"coalesce_ms must be an integer 0..{self.config.max_coalesce_ms}")
        hub = self._hub()
        if not await hub.exists(request_id):
            raise _BadRequest(404, "no such request")
        return request_id, grant, after, int(raw) / 1000, hub

    async def events(self, request: Request) -> Response:
        try:
            request_id, grant, after, window, hub = await self._open(request)
        except AuthError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)
        except _BadRequest as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status)
        if request.method == "HEAD":
            return Response(media_type="text/event-stream")
        return _EventStream(self, hub, request_id, grant, after, window)

    async def websocket(self, ws: WebSocket) -> None:
        try:
            request_id, grant, after, window, hub = await self._open(ws)
        except (AuthError, _BadRequest) as exc:
            await _deny(ws, exc.status, exc.message)
            return
        client = _client_name(ws.scope)
        try:
            async with hub.subscribe(request_id, after, allow_internal=grant.allow_internal, client=client) as sub:
                await ws.accept()
                await self._pump_ws(ws, sub, window)
        except HubClosed:
            await _deny(ws, 503, "the relay is shutting down")

    async def _pump_ws(self, ws: WebSocket, sub: Subscription, window: float) -> None:
        with anyio.CancelScope() as cut:
            sub.cancel_scope = cut
            async with anyio.create_task_group() as tg:
                tg.start_soon(_ws_until_disconnect, ws, tg.cancel_scope)
                async with contextlib.aclosing(_frames(sub, window, self.config.heartbeat)) as batches:
                    async for batch in batches:
                        if not batch:
                            await ws.send_text('{"event":"heartbeat"}')
                        for f in batch:
                            await ws.send_text(ws_message(f))
                if sub.end_reason == "final":
                    await ws.send_text(f'{{"event":"end","data":{_end_payload(sub.final).decode()}}}')
                    await ws.close(1000)
                elif sub.end_reason == "error":
                    await ws.close(1011, "the relay could not read this request")
                else:
                    await ws.close(1012, "the relay is restarting")  # RFC 6455 7.4.1 (IANA): service restart
                tg.cancel_scope.cancel()
        if cut.cancelled_caught and not self.abort_connection(ws.scope):
            # Cut off as too slow: the send may never drain, so the close gets a moment, not more.
            with anyio.move_on_after(1, shield=True), contextlib.suppress(Exception):
                await ws.close(1008, "too slow: the buffer is full")

    async def page(self, request: Request) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8", headers=self._page_headers)

    async def health(self, request: Request) -> Response:
        hub = self.hub
        return JSONResponse({"ok": hub is not None and not hub.closing, **(hub.statistics() if hub else {})})


def _page_headers(html: bytes) -> dict[str, str]:
    """The page's token is in its URL: no Referer may carry it away, and only the page's own inline
    script (pinned by its hash) may run."""
    script = html.split(b"<script>", 1)[1].split(b"</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    csp = (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    )
    return {
        "Cache-Control": "no-cache", "Content-Security-Policy": csp, "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }  # fmt: skip


async def _until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _ws_until_disconnect(ws: WebSocket, scope: anyio.CancelScope) -> None:
    with contextlib.suppress(WebSocketDisconnect):
        while (await ws.receive())["type"] != "websocket.disconnect":
            pass
    scope.cancel()


async def _deny(ws: WebSocket, status: int, message: str) -> None:
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(JSONResponse({"error": message}, status_code=status))
    else:
        await ws.close(1008, message)


def _client_name(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


class _EventStream(Response):
    """The SSE response: runs the client's subscription, its disconnect watch and its cut-off scope."""

    media_type = "text/event-stream"

    def __init__(self, relay: Relay, hub: Hub, request_id: str, grant: Grant, after: Position, window: float) -> None:
        self.relay, self.hub, self.request_id, self.grant, self.after, self.window = (
            relay, hub, request_id, grant, after, window
        )  # fmt: skip
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = _client_name(scope)
        try:
            async with self.hub.subscribe(
                self.request_id, self.after, allow_internal=self.grant.allow_internal, client=client
            ) as sub:
                if sub.final is not None and self.after >= sub.final:
                    # Nothing will ever follow: 204 makes EventSource stop reconnecting (WHATWG HTML 9.2.3).
                    await send({"type": "http.response.start", "status": 204, "headers": []})
                    await send({"type": "http.response.body", "body": b""})
                    return
                await self._stream(sub, scope, receive, send)
        except HubClosed:
            await JSONResponse({"error": "the relay is shutting down"}, status_code=503)(scope, receive, send)

    async def _stream(self, sub: Subscription, scope: Scope, receive: Receive, send: Send) -> None:
        config = self.relay.config
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache, no-transform"),
            (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
        ]
        with anyio.CancelScope() as cut:
            sub.cancel_scope = cut
            async with anyio.create_task_group() as tg:
                tg.start_soon(_until_disconnect, receive, tg.cancel_scope)
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await _body(send, b"retry: %d\n: sluice relay\n\n" % config.retry_ms)
                async with contextlib.aclosing(_frames(sub, self.window, config.heartbeat)) as batches:
                    async for batch in batches:
                        await _body(send, b"".join(map(sse_frame, batch)) or b": heartbeat\n\n")
                if sub.end_reason == "final":
                    await _body(send, b"event: end\ndata: %s\n\n" % _end_payload(sub.final))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        if cut.cancelled_caught:
            # Cut off as too slow: drop the connection now (or, where the server cannot, return without
            # ending the body, which makes it close the connection once its buffer has drained).
            CUT_OFF.set(True)
            self.relay.abort_connection(scope)


async def _body(send: Send, chunk: bytes) -> None:
    message: Message = {"type": "http.response.body", "body": chunk, "more_body": True}
    await send(message)


def create_app(config: RelayConfig, *, redis: AnyRedis | None = None) -> Starlette:
    """The relay as an ASGI app; ``app.state.relay.hub`` is the running hub (``statistics()``)."""
    relay = Relay(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        client = redis or (
            connect(config.redis_url, cluster=True, max_connections=config.redis_max_connections)
            if config.redis_cluster
            else aioredis.Redis.from_pool(
                aioredis.BlockingConnectionPool.from_url(
                    config.redis_url, max_connections=config.redis_max_connections, timeout=None
                )
            )
        )
        # The hub only sends single-slot commands (one request's keys), which a cluster client routes.
        hub = Hub(
            cast(aioredis.Redis, client), Keys(config.key_prefix), buffer=config.buffer, block_ms=config.block_ms,
            page=config.page,
        )  # fmt: skip
        try:
            async with hub.running():
                relay.hub = hub
                yield {}
        finally:
            relay.hub = None
            if redis is None:
                await client.aclose()

    app = Starlette(
        routes=[
            Route("/", relay.page),
            Route("/view/{request_id}", relay.page),
            Route("/healthz", relay.health),
            Route("/v1/requests/{request_id}/events", relay.events),
            WebSocketRoute("/v1/requests/{request_id}/ws", relay.websocket),
        ],
        lifespan=lifespan,
    )
    app.state.relay = relay
    return app

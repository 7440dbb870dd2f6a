"""The relay's HTTP surface: one request's normalized stream as Server-Sent Events, the AI SDK's UI message
stream, or WebSocket messages; many requests over one multiplexed WebSocket.

Rule: every stream endpoint validates its parameters (400), then the origin (403), then the one credential
(400 ``invalid_request`` for more than one, whatever their validity; 401 without one, 403 with one that
does not grant this request), and serves no data otherwise. Each event goes
out as it is stored: SSE ``id:`` its position ``<attempt>-<seq>``, ``event:`` its contract type, ``data:``
its contract JSON (WebSocket: one text message ``{"id", "event", "data"}``); a client resumes from
``Last-Event-ID`` (it wins over ``?after=``, since a browser sends it on every reconnect) and gets exactly
the events after that position. After the final attempt's terminal event the relay sends ``event: end``
and closes; a client resuming at or after that position gets ``204 No Content``, which tells EventSource
not to reconnect. Heartbeat comments keep idle connections (and proxies) open. ``?coalesce_ms=N`` asks for
the UI projection of ``sluice.relay.coalesce``; ``?format=ai-sdk`` for ``sluice.relay.aisdk``.

A client the relay cannot serve now (Redis unreachable, the client limit reached, shutting down) gets
``503`` with ``Retry-After`` and, when it accepts ``text/event-stream``, an SSE body with ``retry:``; both
are jittered. A client that takes no bytes for ``write_timeout`` seconds is cut off and logged, whether it
is live or catching up.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import anyio
import anyio.lowlevel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from sluice.schemas.keys import REQUEST_ID_RULE, Keys, valid_request_id

from . import metrics
from .aisdk import HEADERS as AI_SDK_HEADERS
from .aisdk import UIMessageStream
from .auth import AuthError, Grant, RelayAuth, bearer_token, one_credential
from .coalesce import Frame
from .config import RelayConfig
from .connections import RelayRedis
from .hub import TRANSIENT, Hub, HubClosed, HubFull, NotFound, ReaderFailed, Subscription, Unavailable
from .limits import RetryHint, retry_hint
from .mux import serve_mux
from .origins import CorsMiddleware, OriginPolicy
from .params import ParamError, StreamParams, parse_stream_params
from .positions import START, Position
from .wire import (
    Refused,
    auth_refused,
    client_name,
    deny,
    end_payload,
    frames,
    refused_response,
    sse_frame,
    ws_message,
)

__all__ = ["CUT_OFF", "SESSION_COOKIE", "Relay", "RelayConfig", "create_app", "sse_frame", "ws_message"]

log = logging.getLogger("sluice.relay")

STATIC = Path(__file__).resolve().parent / "static"
SESSION_COOKIE = "sluice_session"
# Set in the request's own task when the relay cut the client off on purpose (see server.QuietCutOff).
CUT_OFF: ContextVar[bool] = ContextVar("sluice_relay_cut_off", default=False)


class Relay:
    """The endpoints' shared state: config, auth, origins and (while the app runs) the hub."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.auth = RelayAuth(config.secrets)
        self.origins = OriginPolicy(config.allowed_origins)
        self.hub: Hub | None = None
        self.redis: RelayRedis | None = None
        self.mux_sockets = 0
        # Set by the server that runs the app (``server.RelayServer``): drops a connection at once,
        # buffered bytes and all. ASGI has no abort; without it a cut-off client's connection is closed
        # only after the server flushed what it had buffered.
        self.abort: Callable[[Scope], bool] | None = None
        self._page = (STATIC / "index.html").read_bytes()
        self._page_headers = _page_headers(self._page)
        self._script = (STATIC / "sluice.js").read_bytes()

    def abort_connection(self, scope: Scope) -> bool:
        return self.abort(scope) if self.abort is not None else False

    def retry(self) -> RetryHint:
        return retry_hint(self.config.retry_after, self.config.retry_jitter)

    def running_hub(self) -> Hub:
        if self.hub is None or self.hub.closing:
            raise Refused(503, "the relay is shutting down", self.retry())
        return self.hub

    # -- access ---------------------------------------------------------------------------------------

    def grant(self, conn: HTTPConnection, request_id: str, query_token: str | None) -> Grant:
        """The grant of the request's one credential: the Authorization header, ``?token=`` or the session
        cookie. Raises ``AuthError``: 400 ``invalid_request`` for more than one (checked before any is,
        so a valid one beside a wrong one is refused too), 401 for none, else its refusal."""
        token = one_credential(
            bearer_token(conn.headers.getlist("authorization")),
            query_token,
            conn.cookies.get(SESSION_COOKIE) or None,  # an emptied cookie is no session
        )
        if token is None:
            raise AuthError(401, "a token is required (Authorization: Bearer <token>, ?token= or a session)")
        return self.auth.check(token, request_id, time.time())

    def check_origin(self, conn: HTTPConnection) -> None:
        allowed, _ = self.origins.check(conn.headers)
        if not allowed:
            raise Refused(403, "origin not allowed")

    def open_stream(self, conn: HTTPConnection, formats: tuple[str, ...]) -> tuple[str, Grant, StreamParams, Hub]:
        """Everything a stream needs checked before Redis is asked. Raises ``Refused`` / ``AuthError``."""
        request_id = conn.path_params["request_id"]
        if not valid_request_id(request_id):
            raise Refused(400, f"the request id must be {REQUEST_ID_RULE}")
        try:
            params = parse_stream_params(
                conn.query_params.multi_items(),
                conn.headers,
                max_coalesce_ms=self.config.max_coalesce_ms,
                formats=formats,
            )
        except ParamError as exc:
            raise Refused(400, str(exc)) from None
        self.check_origin(conn)
        grant = self.grant(conn, request_id, params.token)
        return request_id, grant, params, self.running_hub()

    def refusal_of(self, exc: BaseException) -> Refused:
        """The answer for a failed join (hub exceptions and Redis errors)."""
        if isinstance(exc, Refused):
            return exc
        if isinstance(exc, AuthError):
            return Refused(exc.status, exc.message, code=exc.code)
        if isinstance(exc, NotFound):
            return Refused(404, "no such request")
        if isinstance(exc, ReaderFailed):
            return Refused(500, str(exc))
        if isinstance(exc, HubFull):
            return Refused(503, str(exc), self.retry())
        if isinstance(exc, HubClosed):
            return Refused(503, "the relay is shutting down", self.retry())
        return Refused(503, "Redis is unreachable; try again later", self.retry())

    # -- endpoints ------------------------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        try:
            request_id, grant, params, hub = self.open_stream(request, ("sse", "ai-sdk"))
        except (Refused, AuthError) as exc:
            return refused_response(self.refusal_of(exc), request)
        if request.method == "HEAD":
            head = AI_SDK_HEADERS if params.format == "ai-sdk" else _SseEncoder.headers
            return Response(headers={k.decode(): v.decode() for k, v in head})
        return _EventStream(self, hub, request_id, grant, params)

    async def websocket(self, ws: WebSocket) -> None:
        try:
            request_id, grant, params, hub = self.open_stream(ws, ("sse",))
        except (Refused, AuthError) as exc:
            await deny(ws, self.refusal_of(exc))
            return
        client = client_name(ws.scope)
        async with contextlib.AsyncExitStack() as stack:
            try:
                sub = await stack.enter_async_context(
                    hub.subscribe(request_id, params.after, allow_internal=grant.allow_internal, client=client)
                )
            except (HubClosed, HubFull, NotFound, ReaderFailed, Unavailable) as exc:
                await deny(ws, self.refusal_of(exc))
                return
            await ws.accept()
            await self._pump_ws(ws, sub, params.window)

    async def _pump_ws(self, ws: WebSocket, sub: Subscription, window: float) -> None:
        with anyio.CancelScope() as cut:
            sub.cancel_scope = cut
            async with anyio.create_task_group() as tg:
                tg.start_soon(_ws_until_disconnect, ws, tg.cancel_scope)
                send = self.timed(sub, ws.send_text)
                async with contextlib.aclosing(frames(sub, window, self.config.heartbeat)) as batches:
                    async for batch in batches:
                        if not batch:
                            await send('{"event":"heartbeat"}')
                        for f in batch:
                            await send(ws_message(f))
                if sub.end_reason == "final":
                    await send(f'{{"event":"end","data":{end_payload(sub.final).decode()}}}')
                    await ws.close(1000)
                elif sub.end_reason == "error":
                    await ws.close(1011, "the relay could not read this request")
                else:
                    await ws.close(1012, "the relay is restarting")  # RFC 6455 7.4.1 (IANA): service restart
                tg.cancel_scope.cancel()
        if cut.cancelled_caught and not self.abort_connection(ws.scope):
            # Cut off as too slow: the send may never drain, so the close gets a moment, not more.
            with anyio.move_on_after(1, shield=True), contextlib.suppress(Exception):
                await ws.close(1008, "too slow: the client stopped reading")

    def timed(self, sub: Subscription, send: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``send`` with the write timeout: a client whose socket takes nothing for ``write_timeout``
        seconds is cut off (the cancellation then unwinds its response like a full buffer does)."""
        limit = self.config.write_timeout
        hub = sub.hub

        async def timed_send(message: Any) -> None:
            try:
                with anyio.fail_after(limit):
                    await send(message)
            except TimeoutError:
                hub.cut(sub, f"no write completed in {limit:g} s")
                await anyio.lowlevel.checkpoint()  # the cut cancelled our scope: unwind now
                raise

        return timed_send

    async def mux(self, ws: WebSocket) -> None:
        await serve_mux(self, ws)

    async def session(self, request: Request) -> Response:
        """Exchange a (short-lived) token for an HttpOnly cookie scoped to this request's endpoints, so
        EventSource reconnects need no token in the URL; DELETE ends the session."""
        request_id = request.path_params["request_id"]
        if not valid_request_id(request_id):
            return JSONResponse({"error": f"the request id must be {REQUEST_ID_RULE}"}, 400)
        try:
            self.check_origin(request)
        except Refused as exc:
            return refused_response(exc, request)
        path = f"/v1/requests/{quote(request_id, safe='')}/"
        attrs = f"Path={path}; HttpOnly; SameSite={self.config.cookie_samesite}"
        if self.config.cookie_secure:
            attrs += "; Secure"
        if request.method == "DELETE":
            return Response(status_code=204, headers={"set-cookie": f"{SESSION_COOKIE}=; Max-Age=0; {attrs}"})
        try:
            token = bearer_token(request.headers.getlist("authorization"))
            grant = self.auth.check(token, request_id, time.time())
        except AuthError as exc:
            return auth_refused(exc)
        expires = int(time.time()) + self.config.session_ttl
        session = self.auth.sign(request_id, expires, allow_internal=grant.allow_internal)
        cookie = f"{SESSION_COOKIE}={session}; Max-Age={self.config.session_ttl}; {attrs}"
        return JSONResponse(
            {"request_id": request_id, "expires_at": expires},
            headers={"set-cookie": cookie, "cache-control": "no-store"},
        )

    async def page(self, request: Request) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8", headers=self._page_headers)

    async def script(self, request: Request) -> Response:
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        return Response(self._script, media_type="text/javascript; charset=utf-8", headers=headers)

    async def health(self, request: Request) -> Response:
        """Liveness: the process serves HTTP. Public, and says nothing else."""
        return JSONResponse({"ok": True})

    async def ready(self, request: Request) -> Response:
        """Readiness: Redis answers and the relay is not shutting down."""
        hub, redis = self.hub, self.redis
        error = "shutting down" if hub is None or hub.closing or redis is None else None
        if error is None and redis is not None:
            try:
                with anyio.fail_after(self.config.redis_timeout):
                    await redis.commands.ping()
            except (TimeoutError, *TRANSIENT):
                error = "Redis is unreachable"
        if error is None:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "error": error}, 503, headers={"retry-after": self.retry().header})

    async def metrics(self, request: Request) -> Response:
        """Counters in the Prometheus text format; a deployment secret is required (Bearer)."""
        try:
            grant = self.auth.inspect(bearer_token(request.headers.getlist("authorization")), time.time())
        except AuthError as exc:
            return auth_refused(exc)
        if grant.request_id is not None:
            return JSONResponse({"error": "metrics need a deployment secret, not a request token"}, 403)
        return Response(metrics.render(self), media_type="text/plain; version=0.0.4; charset=utf-8")


def _page_headers(html: bytes) -> dict[str, str]:
    """The page's token is in its URL until the page trades it for a session: no Referer may carry it
    away, and only the page's own inline script (pinned by its hash) and the relay's module may run."""
    script = html.split(b'<script type="module">', 1)[1].split(b"</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    csp = (
        f"default-src 'none'; script-src 'self' 'sha256-{digest}'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    )
    return {
        "Cache-Control": "no-cache",
        "Content-Security-Policy": csp,
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }


async def _until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _ws_until_disconnect(ws: WebSocket, scope: anyio.CancelScope) -> None:
    with contextlib.suppress(WebSocketDisconnect):
        while (await ws.receive())["type"] != "websocket.disconnect":
            pass
    scope.cancel()


class _SseEncoder:
    headers: ClassVar[list[tuple[bytes, bytes]]] = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache, no-transform"),
        (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
    ]

    def __init__(self, retry_ms: int) -> None:
        self.retry_ms = retry_ms

    def opening(self) -> bytes:
        return b"retry: %d\n: sluice relay\n\n" % self.retry_ms

    def batch(self, batch: list[Frame], final: Position | None) -> bytes:
        return b"".join(map(sse_frame, batch))

    def closing(self, final: Position | None) -> bytes:
        return b"event: end\ndata: %s\n\n" % end_payload(final) if final is not None else b""


class _AiSdkEncoder:
    headers = AI_SDK_HEADERS

    def __init__(self, request_id: str, after: Position, after_part: int | None) -> None:
        self.stream = UIMessageStream(request_id, after, after_part)

    def opening(self) -> bytes:
        return b""

    def batch(self, batch: list[Frame], final: Position | None) -> bytes:
        return self.stream.push(batch, final)

    def closing(self, final: Position | None) -> bytes:
        return self.stream.close(final)


class _EventStream(Response):
    """The SSE response: joins the hub, then runs the client's subscription, its disconnect watch and
    its cut-off scope. Join failures become 404 / 503 before any byte of the stream."""

    media_type = "text/event-stream"

    def __init__(self, relay: Relay, hub: Hub, request_id: str, grant: Grant, params: StreamParams) -> None:
        self.relay, self.hub, self.request_id, self.grant, self.params = relay, hub, request_id, grant, params
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = client_name(scope)
        ai_sdk = self.params.format == "ai-sdk"
        # The AI SDK mapping needs the whole request to know each block's state; it skips what the client had.
        after = START if ai_sdk else self.params.after
        async with contextlib.AsyncExitStack() as stack:
            try:
                sub = await stack.enter_async_context(
                    self.hub.subscribe(self.request_id, after, allow_internal=self.grant.allow_internal, client=client)
                )
            except (HubClosed, HubFull, NotFound, ReaderFailed, Unavailable) as exc:
                await refused_response(self.relay.refusal_of(exc), HTTPConnection(scope))(scope, receive, send)
                return
            past = self.params.after > sub.final if sub.final is not None else False
            if sub.final is not None and (past or (self.params.after == sub.final and self.params.after_part is None)):
                # Nothing will ever follow: 204 makes EventSource stop reconnecting (WHATWG HTML 9.2.3)
                # and tells useChat there is no stream to resume.
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            encoder: _SseEncoder | _AiSdkEncoder = (
                _AiSdkEncoder(self.request_id, self.params.after, self.params.after_part)
                if ai_sdk
                else _SseEncoder(retry_hint(self.relay.config.retry_ms / 1000, self.relay.config.retry_ms / 1000).ms)
            )
            await self._stream(sub, encoder, scope, receive, send)

    async def _stream(
        self, sub: Subscription, encoder: _SseEncoder | _AiSdkEncoder, scope: Scope, receive: Receive, send: Send
    ) -> None:
        config = self.relay.config
        write = self.relay.timed(sub, send)

        async def body(chunk: bytes) -> None:
            message: Message = {"type": "http.response.body", "body": chunk, "more_body": True}
            await write(message)

        with anyio.CancelScope() as cut:
            sub.cancel_scope = cut
            async with anyio.create_task_group() as tg:
                tg.start_soon(_until_disconnect, receive, tg.cancel_scope)
                await send({"type": "http.response.start", "status": 200, "headers": encoder.headers})
                if opening := encoder.opening():
                    await body(opening)
                async with contextlib.aclosing(frames(sub, self.params.window, config.heartbeat)) as batches:
                    async for batch in batches:
                        await body(encoder.batch(batch, sub.final) or b": heartbeat\n\n")
                if closing := encoder.closing(sub.final if sub.end_reason == "final" else None):
                    await body(closing)
                await write({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        if cut.cancelled_caught:
            # Cut off as too slow: drop the connection now (or, where the server cannot, return without
            # ending the body, which makes it close the connection once its buffer has drained).
            CUT_OFF.set(True)
            self.relay.abort_connection(scope)


def create_app(config: RelayConfig) -> Starlette:
    """The relay as an ASGI app; ``app.state.relay.hub`` is the running hub (``statistics()``)."""
    relay = Relay(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        redis = RelayRedis(config)
        hub = Hub(
            redis.commands,
            Keys(config.key_prefix),
            reader=redis.reader,
            buffer=config.buffer,
            block_ms=config.block_ms,
            page=config.page,
            lanes=config.reader_lanes,
            catchup_concurrency=config.redis_pool_size,
            max_clients=config.max_clients,
            lane_per_slot=config.redis_cluster,
        )
        try:
            async with hub.running():
                relay.hub, relay.redis = hub, redis
                yield {}
        finally:
            relay.hub = None
            await redis.aclose()
            relay.redis = None

    app = Starlette(
        routes=[
            Route("/", relay.page),
            Route("/view/{request_id}", relay.page),
            Route("/static/sluice.js", relay.script),
            Route("/healthz", relay.health),
            Route("/readyz", relay.ready),
            Route("/metrics", relay.metrics),
            Route("/v1/requests/{request_id}/events", relay.events, methods=["GET", "HEAD"]),
            Route("/v1/requests/{request_id}/session", relay.session, methods=["POST", "DELETE"]),
            WebSocketRoute("/v1/requests/{request_id}/ws", relay.websocket),
            WebSocketRoute("/v1/ws", relay.mux),
        ],
        middleware=[Middleware(CorsMiddleware, policy=relay.origins)],
        lifespan=lifespan,
    )
    app.state.relay = relay
    return app

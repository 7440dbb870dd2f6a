"""Many requests over one WebSocket (``/v1/ws``): a browser's connection limit per origin (six over
HTTP/1.1) no longer caps how many streams a page follows, and tokens are refreshed in-band.

Rule: the client sends JSON text messages (at most 16 KiB each); every message the relay sends is one
JSON object, and everything about a request carries its ``request_id``:

- ``{"type": "auth", "token": T}``: remember ``T`` for later subscribes (a new token for the same request
  replaces the old, so a page refreshes its access before the old token expires). Answer:
  ``{"event": "auth", "data": {"ok": true, "request_id": R | null, "expires_at": E | null}}`` or
  ``{"event": "auth", "data": {"ok": false, "status": 401 | 403, "error": ...}}``.
- ``{"type": "subscribe", "request_id": R, "after"?: P, "coalesce_ms"?: N, "token"?: T}``: follow R from
  just after P (default: its start), with T or else a remembered token. Answer
  ``{"request_id": R, "event": "subscribed", "data": {"after": P}}``, then R's events as
  ``{"request_id": R, "id": "<attempt>-<seq>", "event": <type>, "data": <contract JSON>}`` and finally
  ``{"request_id": R, "event": "end", "data": {"final": P}}``.
- ``{"type": "unsubscribe", "request_id": R}``: stop; answer ``{"request_id": R, "event": "unsubscribed"}``.

A subscription the relay cannot serve, or that breaks, ends with ``{"request_id": R, "event": "error",
"data": {"status": S, "error": ..., "retry_after_ms"?: M}}`` using the HTTP statuses of the SSE endpoint
(400, 401, 403, 404, 409 already subscribed, 429 too many streams on this socket, 500, 503 with a jittered
delay); the socket stays open. A malformed message gets ``{"event": "error", "data": {"status": 400,
...}}``. ``{"event": "heartbeat"}`` comes every heartbeat interval.

Close codes: 1000 normal; 1008 origin not allowed (when the server cannot refuse the handshake with
403) or the client stopped reading (every subscription shares the socket, so a stalled reader is cut
whole); 1011 internal error; 1012 the relay is restarting (resubscribe with ``after`` = the last id).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from sluice.schemas.keys import REQUEST_ID_RULE, valid_request_id

from .auth import AuthError, Grant
from .hub import HubClosed, HubFull, NotFound, ReaderFailed, Subscription, Unavailable
from .positions import Position, PositionError, parse_position
from .wire import Refused, client_name, deny, end_payload, frames, ws_message

if TYPE_CHECKING:
    from .app import Relay

__all__ = ["MAX_MESSAGE", "serve_mux"]

MAX_MESSAGE = 16 * 1024
_MAX_TOKENS = 64
_ENC = msgspec.json.Encoder()


class _Message(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    request_id: str | None = None
    after: str | None = None
    coalesce_ms: int = 0
    token: str | None = None


_DECODER = msgspec.json.Decoder(_Message)


class _Bad(Exception):
    def __init__(self, status: int, message: str, retry_ms: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_ms = status, message, retry_ms


async def serve_mux(relay: Relay, ws: WebSocket) -> None:
    try:
        relay.check_origin(ws)
        hub = relay.running_hub()
    except Refused as exc:
        await deny(ws, exc)
        return
    await ws.accept()
    relay.mux_sockets += 1
    try:
        await _Mux(relay, ws).run(hub.closed)
    finally:
        relay.mux_sockets -= 1


class _Mux:
    def __init__(self, relay: Relay, ws: WebSocket) -> None:
        self.relay = relay
        self.ws = ws
        self.config = relay.config
        self.tokens: list[str] = []  # newest first
        self.subs: dict[str, anyio.CancelScope] = {}
        self.lock = anyio.Lock()
        self.cut = anyio.CancelScope()
        self.shutting_down = False
        self.tg: anyio.abc.TaskGroup | None = None

    async def run(self, closed: anyio.Event) -> None:
        with self.cut:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                tg.start_soon(self._heartbeats)
                tg.start_soon(self._on_shutdown, closed)
                with contextlib.suppress(WebSocketDisconnect):
                    while True:
                        message = await self.ws.receive()
                        if message["type"] == "websocket.disconnect":
                            break
                        await self._handle(message.get("text"), message.get("bytes"))
                tg.cancel_scope.cancel()
        if self.shutting_down:
            with anyio.move_on_after(1, shield=True), contextlib.suppress(Exception):
                await self.ws.close(1012, "the relay is restarting")
        elif self.cut.cancelled_caught and not self.relay.abort_connection(self.ws.scope):
            with anyio.move_on_after(1, shield=True), contextlib.suppress(Exception):
                await self.ws.close(1008, "too slow: the client stopped reading")

    async def _on_shutdown(self, closed: anyio.Event) -> None:
        await closed.wait()
        self.shutting_down = True
        self.cut.cancel()

    async def _heartbeats(self) -> None:
        while True:
            await anyio.sleep(self.config.heartbeat)
            await self._send_timed('{"event":"heartbeat"}')

    async def _send(self, text: str) -> None:
        async with self.lock:
            await self.ws.send_text(text)

    async def _send_all(self, texts: list[str]) -> None:
        """A batch of messages under one lock (and, from ``_stream``, one write timeout)."""
        async with self.lock:
            for text in texts:
                await self.ws.send_text(text)

    async def _send_timed(self, text: str) -> None:
        """A control message under the write timeout; a stalled socket is cut whole."""
        try:
            with anyio.fail_after(self.config.write_timeout):
                await self._send(text)
        except TimeoutError:
            self.cut.cancel()
            await anyio.lowlevel.checkpoint()
            raise

    async def _reply(self, doc: dict[str, Any]) -> None:
        await self._send_timed(_ENC.encode(doc).decode())

    async def _error(self, request_id: str | None, exc: _Bad) -> None:
        data: dict[str, Any] = {"status": exc.status, "error": exc.message}
        if exc.retry_ms is not None:
            data["retry_after_ms"] = exc.retry_ms
        doc: dict[str, Any] = {"event": "error", "data": data}
        if request_id is not None:
            doc = {"request_id": request_id, **doc}
        await self._reply(doc)

    # -- client messages ------------------------------------------------------------------------------

    async def _handle(self, text: str | None, data: bytes | None) -> None:
        raw = text.encode() if text is not None else data or b""
        msg: _Message | None = None
        try:
            if len(raw) > MAX_MESSAGE:
                raise _Bad(413, f"messages are at most {MAX_MESSAGE} bytes")
            try:
                msg = _DECODER.decode(raw)
            except msgspec.DecodeError as exc:
                raise _Bad(400, f"not a message: {exc}") from None
            if msg.type == "auth":
                await self._auth(msg)
            elif msg.type == "subscribe":
                await self._subscribe(msg)
            elif msg.type == "unsubscribe":
                rid = self._request_id(msg)
                if (scope := self.subs.pop(rid, None)) is not None:
                    scope.cancel()
                await self._reply({"request_id": rid, "event": "unsubscribed"})
            else:
                raise _Bad(400, f"unknown message type {msg.type[:40]!r} (auth, subscribe, unsubscribe)")
        except _Bad as exc:
            named = msg.request_id if msg is not None else None
            await self._error(named if named is not None and valid_request_id(named) else None, exc)

    def _request_id(self, msg: _Message) -> str:
        if msg.request_id is None or not valid_request_id(msg.request_id):
            raise _Bad(400, f"request_id must be {REQUEST_ID_RULE}")
        return msg.request_id

    async def _auth(self, msg: _Message) -> None:
        try:
            grant = self.relay.auth.inspect(msg.token, time.time())
        except AuthError as exc:
            await self._reply({"event": "auth", "data": {"ok": False, "status": exc.status, "error": exc.message}})
            return
        assert msg.token is not None
        if grant.request_id is not None:
            # The newer token for a request replaces the older one.
            self.tokens = [t for t in self.tokens if not self._grants(t, grant.request_id)]
        self.tokens = [msg.token, *self.tokens][:_MAX_TOKENS]
        await self._reply(
            {"event": "auth", "data": {"ok": True, "request_id": grant.request_id, "expires_at": grant.expires_at}}
        )

    def _grants(self, token: str, request_id: str) -> bool:
        try:
            grant = self.relay.auth.inspect(token, time.time())
        except AuthError:
            return True  # expired or invalid: drop it as well
        return grant.request_id == request_id

    def _grant(self, msg: _Message, request_id: str) -> Grant:
        candidates = [msg.token] if msg.token else []
        candidates += self.tokens
        refusal: AuthError | None = None
        for token in candidates:
            try:
                return self.relay.auth.check(token, request_id, time.time())
            except AuthError as exc:
                refusal = refusal or exc
        raise refusal or AuthError(401, "a token is required (an auth message or the subscribe's token)")

    async def _subscribe(self, msg: _Message) -> None:
        rid = self._request_id(msg)
        try:
            after = parse_position(msg.after)
        except PositionError as exc:
            raise _Bad(400, str(exc)) from None
        if not 0 <= msg.coalesce_ms <= self.config.max_coalesce_ms:
            raise _Bad(400, f"coalesce_ms must be an integer 0..{self.config.max_coalesce_ms}")
        try:
            grant = self._grant(msg, rid)
        except AuthError as exc:
            raise _Bad(exc.status, exc.message) from None
        if rid in self.subs:
            raise _Bad(409, "already subscribed to this request on this socket")
        if len(self.subs) >= self.config.max_streams_per_socket:
            raise _Bad(429, f"at most {self.config.max_streams_per_socket} streams per socket")
        scope = self.subs[rid] = anyio.CancelScope()
        assert self.tg is not None
        self.tg.start_soon(self._follow, rid, grant, after, msg.coalesce_ms / 1000, scope)

    async def _follow(self, rid: str, grant: Grant, after: Position, window: float, scope: anyio.CancelScope) -> None:
        relay = self.relay
        client = client_name(self.ws.scope)
        try:
            with scope:
                async with contextlib.AsyncExitStack() as stack:
                    try:
                        hub = relay.running_hub()
                        sub = await stack.enter_async_context(
                            hub.subscribe(rid, after, allow_internal=grant.allow_internal, client=client)
                        )
                    except (Refused, HubClosed, HubFull, NotFound, ReaderFailed, Unavailable) as exc:
                        refusal = relay.refusal_of(exc)
                        retry = refusal.retry.ms if refusal.retry is not None else None
                        await self._error(rid, _Bad(refusal.status, refusal.message, retry))
                        return
                    sub.cancel_scope = self.cut  # a full buffer cuts the socket: it is not being read
                    await self._stream(rid, sub, after, window)
        finally:
            if self.subs.get(rid) is scope:
                del self.subs[rid]

    async def _stream(self, rid: str, sub: Subscription, after: Position, window: float) -> None:
        send = self.relay.timed(sub, self._send)
        send_all = self.relay.timed(sub, self._send_all)
        await send(_ENC.encode({"request_id": rid, "event": "subscribed", "data": {"after": str(after)}}).decode())
        # Heartbeats are the socket's, not each stream's.
        async with contextlib.aclosing(frames(sub, window, 86_400.0)) as batches:
            async for batch in batches:
                if batch:
                    await send_all([ws_message(f, rid) for f in batch])
        if sub.end_reason == "final":
            rid_json = _ENC.encode(rid).decode()
            await send(f'{{"request_id":{rid_json},"event":"end","data":{end_payload(sub.final).decode()}}}')
        elif sub.end_reason == "error":
            await self._error(rid, _Bad(500, "the relay could not read this request"))
        elif sub.end_reason == "shutdown":
            self.shutting_down = True
            self.cut.cancel()

"""What the stream endpoints share: SSE and WebSocket framing, the batching of a subscription into
frames with heartbeats, and how a refused client is answered.

Rule: a refusal is an HTTP status and a message, never a stack trace; a 503 also says when to come back
(``Retry-After``, and ``retry:`` in an SSE body for a client that accepts ``text/event-stream``); a refusal
with an RFC 6750 error code (``invalid_request``) carries it in the body's ``code`` and in
``WWW-Authenticate: Bearer error="..."``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import anyio
import msgspec
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, Response
from starlette.types import Scope
from starlette.websockets import WebSocket

from .auth import AuthError
from .coalesce import Coalescer, Frame, frame_of
from .hub import Subscription
from .limits import RetryHint
from .positions import Position

__all__ = [
    "Refused",
    "auth_refused",
    "client_name",
    "deny",
    "end_payload",
    "frames",
    "refused_response",
    "sse_frame",
    "ws_message",
    "www_authenticate",
]

_ENC = msgspec.json.Encoder()


class Refused(Exception):
    """A stream request the relay will not serve: an HTTP status and a message (and, for 503, when to
    come back; for an RFC 6750 error, its code)."""

    def __init__(self, status: int, message: str, retry: RetryHint | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry = retry
        self.code = code

    def body(self) -> dict[str, str]:
        return {"error": self.message, "code": self.code} if self.code else {"error": self.message}


def sse_frame(frame: Frame) -> bytes:
    """One SSE event; a (never expected) line break in the JSON is split over ``data:`` lines."""
    lines = frame.data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    head = b"id: %s\nevent: %s\n" % (str(frame.position).encode(), frame.type.encode())
    return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


def ws_message(frame: Frame, request_id: str | None = None) -> str:
    """One WebSocket text message: ``{"id": position, "event": type, "data": contract JSON}`` (on the
    multiplexed socket led by ``"request_id"``)."""
    head = f'{{"request_id":{_ENC.encode(request_id).decode()},' if request_id is not None else "{"
    return f'{head}"id":"{frame.position}","event":"{frame.type}","data":{frame.data.decode()}}}'


def end_payload(final: Position | None) -> bytes:
    return _ENC.encode({"final": str(final) if final is not None else None})


async def frames(sub: Subscription, window: float, heartbeat: float) -> AsyncGenerator[list[Frame], None]:
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
            out = [frame_of(e) for e in batch]
        else:
            out = [f for e in batch for f in coalescer.push(e, now)] + coalescer.due(now)
        done = sub.finished
        if done and coalescer is not None:
            out += coalescer.flush()
        if out or now >= next_beat:
            yield out
            next_beat = now + heartbeat
        if done:
            return


def www_authenticate(status: int, code: str | None = None) -> dict[str, str] | None:
    """RFC 6750 §3: a challenge on 401, and the error code of a refusal that has one."""
    if code is not None:
        return {"WWW-Authenticate": f'Bearer error="{code}"'}
    return {"WWW-Authenticate": "Bearer"} if status == 401 else None


def auth_refused(exc: AuthError) -> Response:
    """The answer to a refused credential outside the stream endpoints (session, metrics)."""
    return JSONResponse(
        Refused(exc.status, exc.message, code=exc.code).body(),
        exc.status,
        headers=www_authenticate(exc.status, exc.code),
    )


def refused_response(refusal: Refused, request: HTTPConnection) -> Response:
    """A refused stream: JSON, except that a 503 to a client accepting ``text/event-stream`` is an SSE
    body with the ``retry:`` an EventSource-like client applies."""
    headers = www_authenticate(refusal.status, refusal.code) or {}
    if refusal.retry is not None:
        headers["retry-after"] = refusal.retry.header
        headers["cache-control"] = "no-store"
        if "text/event-stream" in request.headers.get("accept", ""):
            body = b"retry: %d\nevent: error\ndata: %s\n\n" % (
                refusal.retry.ms,
                _ENC.encode({"error": refusal.message, "status": refusal.status}),
            )
            return Response(body, refusal.status, headers=headers, media_type="text/event-stream")
    return JSONResponse(refusal.body(), refusal.status, headers=headers)


async def deny(ws: WebSocket, refusal: Refused) -> None:
    """Refuse a WebSocket before accepting it: an HTTP response where the server supports one (the
    handshake then fails with that status), else close 1008 (policy) or 1013 (try again later)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        headers = www_authenticate(refusal.status, refusal.code) or {}
        if refusal.retry is not None:
            headers["retry-after"] = refusal.retry.header
        await ws.send_denial_response(JSONResponse(refusal.body(), refusal.status, headers=headers))
    else:
        await ws.close(1013 if refusal.status == 503 else 1008, refusal.message)


def client_name(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""

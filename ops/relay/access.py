"""The relay's access log: one record per HTTP request or WebSocket, written when it ends.

Rule: every request leaves one line on ``sluice.relay.access`` once its response is over (a stream when it
ends, whether finished, cut off or dropped by the client; a refusal at once), with the method, the path,
the status, the bytes of body sent, the duration and the client's address. The query string is never
logged (it carries ``?token=``), nor any header. Probes (``/healthz``, ``/readyz``, ``/metrics``) that
succeed are logged at DEBUG so they do not drown the rest; everything else at INFO.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AccessLog"]

log = logging.getLogger("sluice.relay.access")
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


class AccessLog:
    """ASGI middleware around the relay's app (lifespan passes through untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        seen: dict[str, int | bool] = {"status": 0, "bytes": 0, "ended": False, "close_code": 0}

        async def sending(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                seen["status"] = int(message["status"])
            elif kind == "http.response.body":
                seen["bytes"] = int(seen["bytes"]) + len(message.get("body", b""))
                seen["ended"] = not message.get("more_body", False)
            elif kind == "websocket.accept":
                seen["status"] = 101
            elif kind == "websocket.close":
                seen["close_code"] = int(message.get("code", 1000))
                seen["status"] = seen["status"] or 403  # closed before accepting: the server answers 403
            elif kind == "websocket.http.response.start":
                seen["status"] = int(message["status"])
            elif kind == "websocket.send":
                seen["bytes"] = int(seen["bytes"]) + len(message.get("text") or message.get("bytes") or b"")
            await send(message)

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                seen["close_code"] = seen["close_code"] or int(message.get("code", 1005))
            return message

        try:
            await self.app(scope, receiving if scope["type"] == "websocket" else receive, sending)
        except Exception:
            seen["status"] = seen["status"] or 500  # what the server answers for an app that raised
            raise
        finally:
            _record(scope, seen, time.perf_counter() - started)


def _record(scope: Scope, seen: dict[str, int | bool], seconds: float) -> None:
    path = str(scope.get("path", ""))
    status = int(seen["status"])
    client = scope.get("client")
    fields: dict[str, object] = {
        "method": "WS" if scope["type"] == "websocket" else str(scope.get("method", "")),
        "path": path,
        "status": status,
        "bytes": int(seen["bytes"]),
        "ms": round(seconds * 1000, 1),
        "client": f"{client[0]}:{client[1]}" if client else "",
    }
    if scope["type"] == "websocket":
        fields["close_code"] = int(seen["close_code"])
    elif status and not seen["ended"]:
        fields["completed"] = False  # the stream was cut off, or its client went away mid-response
    level = logging.DEBUG if path in _PROBES and 200 <= status < 300 else logging.INFO
    log.log(level, f"{fields['method']} {path} {status or '-'}", extra=fields)

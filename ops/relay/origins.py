"""Which browser origins may use the relay: same origin by default, more only when configured.

Rule: a request without an ``Origin`` header is not a cross-origin browser request (servers, curl, a
same-origin GET) and is judged by its token alone. With one, the origin must be the relay's own (its
``host[:port]`` equals the ``Host`` header: a TLS proxy in front changes the scheme, not the host) or one
of ``allowed_origins`` (``"*"``: any). The same check guards HTTP and WebSocket: a WebSocket handshake
carries cookies and is not subject to CORS, so without it any site could read a stream with a victim's
session cookie. Allowed cross-origin HTTP responses get ``Access-Control-Allow-Origin`` (the origin
itself, with ``Vary: Origin`` and credentials allowed, never ``*``, so cookies work); a preflight gets the
methods and headers the endpoints use; a disallowed origin gets ``403`` before any data.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CorsMiddleware", "OriginPolicy"]

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
ALLOW_METHODS = "GET, HEAD, POST, OPTIONS"
ALLOW_HEADERS = "authorization, content-type, last-event-id, cache-control"
EXPOSE_HEADERS = "retry-after, x-vercel-ai-ui-message-stream"


def _normalize(origin: str) -> str | None:
    """``scheme://host[:port]`` in lower case with the default port dropped; None when malformed."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


class OriginPolicy:
    def __init__(self, allowed: Iterable[str]) -> None:
        self.any = False
        self.allowed: set[str] = set()
        for origin in allowed:
            if origin.strip() == "*":
                self.any = True
                continue
            norm = _normalize(origin)
            if norm is None:
                raise ValueError(f"not an origin (scheme://host[:port]): {origin!r}")
            self.allowed.add(norm)

    def same_origin(self, origin: str, host: str | None) -> bool:
        norm = _normalize(origin)
        if norm is None or not host:
            return False
        scheme, netloc = norm.split("://", 1)
        own = host.strip().lower()
        default = f":{_DEFAULT_PORTS[scheme]}"
        if own.endswith(default):
            own = own[: -len(default)]
        return own == netloc

    def cross_allowed(self, origin: str) -> bool:
        norm = _normalize(origin)
        return norm is not None and (self.any or norm in self.allowed)

    def check(self, headers: Headers) -> tuple[bool, bool]:
        """(allowed, cross-origin) for a request's headers."""
        origin = headers.get("origin")
        if origin is None:
            return True, False
        if self.same_origin(origin, headers.get("host")):
            return True, False
        return self.cross_allowed(origin), True


class CorsMiddleware:
    """Preflights, ``Access-Control-*`` on allowed cross-origin responses, 403 for disallowed origins.
    WebSocket scopes pass through: their endpoints deny with a handshake response themselves."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        allowed, cross = self.policy.check(headers)
        if not cross:
            await self.app(scope, receive, send)
            return
        origin = headers["origin"]
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if not allowed:
            await _plain(send, 403, b'{"error":"origin not allowed"}')
            return
        cors = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-credentials", b"true"),
            (b"vary", b"Origin"),
        ]
        if preflight:
            cors += [
                (b"access-control-allow-methods", ALLOW_METHODS.encode()),
                (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
                (b"access-control-max-age", b"600"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            await send({"type": "http.response.body", "body": b""})
            return
        cors.append((b"access-control-expose-headers", EXPOSE_HEADERS.encode()))

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


async def _plain(send: Send, status: int, body: bytes) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"vary", b"Origin"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

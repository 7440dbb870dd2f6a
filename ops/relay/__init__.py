"""The fan-out relay: requests' normalized streams to many browsers (SSE, the AI SDK's UI message stream,
WebSocket, or many requests over one multiplexed WebSocket).

Rule: the relay only reads Redis (one reader per request, whatever the number of clients) and never
changes what the worker wrote: it forwards events one to one, or coalesced on request, withholding only
what the client's token does not grant.
"""

from __future__ import annotations

from .aisdk import UIMessageStream
from .app import create_app
from .auth import RelayAuth, sign_token
from .config import RelayConfig
from .hub import Hub
from .positions import Position, parse_position
from .server import RunningRelay, serve_relay

__all__ = [
    "Hub",
    "Position",
    "RelayAuth",
    "RelayConfig",
    "RunningRelay",
    "UIMessageStream",
    "create_app",
    "parse_position",
    "serve_relay",
    "sign_token",
]

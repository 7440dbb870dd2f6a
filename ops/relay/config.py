"""The relay's settings, in one frozen record (``sluice relay`` fills it from flags and the environment).

Rule: every limit the relay enforces is here, with the default a single small host can carry; nothing
in the relay reads the environment or a global.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RelayConfig"]


@dataclass(frozen=True, slots=True)
class RelayConfig:
    redis_url: str
    secrets: tuple[str, ...]
    key_prefix: str = "sluice"
    heartbeat: float = 15.0  # seconds between heartbeats on an idle stream
    buffer: int = 1000  # events a client may have waiting before it is cut off
    # The reconnection delay sent to EventSource with every stream, drawn from [retry_ms, 2 * retry_ms]: when a
    # relay restarts, its clients come back spread out.
    retry_ms: int = 1000
    block_ms: int = 1000  # XREAD block of the shared readers
    page: int = 500  # entries per XREAD / catch-up XRANGE call
    max_coalesce_ms: int = 5000
    # Redis connections: a small pool for short commands (existence checks, catch-up pages, status reads,
    # readiness) plus two per reader lane; each lane follows any number of requests with one XREAD.
    redis_pool_size: int = 8
    reader_lanes: int = 2
    redis_timeout: float = 5.0  # connect / reply timeout of the short commands, seconds
    # Clients (one per stream followed, whichever the endpoint): past this, 503 with Retry-After.
    max_clients: int = 10_000
    max_streams_per_socket: int = 64  # subscriptions one multiplexed WebSocket may hold
    # A client whose socket takes no bytes for this long is cut off (also while it catches up).
    write_timeout: float = 10.0
    # The kernel send buffer of each client socket (SO_SNDBUF; Linux doubles it): what a client that
    # stopped reading can leave unacknowledged before writes block and the write timeout runs.
    socket_send_buffer: int = 65_536
    # Answers while Redis is unreachable or the relay is full: 503, Retry-After and an SSE ``retry:``
    # drawn uniformly from [retry_after, retry_after + retry_jitter] seconds, so clients spread out.
    retry_after: float = 2.0
    retry_jitter: float = 3.0
    # Browser access: origins (``scheme://host[:port]``) allowed besides the relay's own; "*" allows any.
    allowed_origins: tuple[str, ...] = ()
    # The cookie a short-lived token is exchanged for (POST /v1/requests/{id}/session).
    session_ttl: int = 3600
    cookie_secure: bool = True
    cookie_samesite: str = "Strict"  # Strict, Lax, or None (cross-site pages; needs cookie_secure)

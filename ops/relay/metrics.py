"""The relay's counters in the Prometheus text format (``GET /metrics``, deployment secret required).

Rule: liveness (``/healthz``) is public and says only that the process serves; every count of clients,
readers, Redis connections and descriptors is here, behind a deployment secret, since it describes
other people's traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .limits import fd_soft_limit, open_fds

if TYPE_CHECKING:
    from .app import Relay

__all__ = ["COUNTERS", "render"]

# Monotonic since start; everything else is a gauge.
COUNTERS = frozenset(
    {
        "readers_started",
        "xreads",
        "catchup_reads",
        "events_read",
        "clients_total",
        "clients_resumed",
        "clients_cut_slow",
        "clients_refused_full",
        "clients_refused_unavailable",
        "clients_not_found",
        "redis_errors",
        "first_read_retries",
    }
)

_HELP = {
    "feeds_active": "requests being served (each read from Redis once)",
    "readers_active": "live requests followed by the reader lanes",
    "readers_started": "requests whose first round trip ran",
    "xreads": "XREAD calls of the reader lanes",
    "catchup_reads": "XRANGE pages read for clients catching up",
    "events_read": "entries the reader lanes read",
    "clients_active": "clients being streamed to",
    "clients_total": "clients that joined a request",
    "clients_resumed": "clients that joined with a position",
    "clients_cut_slow": "clients cut off for not reading (buffer full or write timeout)",
    "clients_refused_full": "clients refused at max_clients (503)",
    "clients_refused_unavailable": "clients refused while Redis was unreachable (503)",
    "clients_not_found": "clients that asked for an unknown request (404)",
    "buffered_events": "events waiting in client buffers",
    "redis_errors": "failed Redis calls",
    "first_read_retries": "first reads of a request retried on a fresh connection after a connection error",
    "redis_connections": "Redis connections open",
    "mux_sockets_active": "multiplexed WebSockets open",
    "open_fds": "file descriptors open",
    "fd_soft_limit": "the soft RLIMIT_NOFILE",
}


def render(relay: Relay) -> str:
    values: dict[str, int] = dict(relay.hub.statistics()) if relay.hub is not None else {}
    values["redis_connections"] = relay.redis.open_connections() if relay.redis is not None else 0
    values["mux_sockets_active"] = relay.mux_sockets
    if (fds := open_fds()) is not None:
        values["open_fds"] = fds
    if (soft := fd_soft_limit()) is not None:
        values["fd_soft_limit"] = soft
    lines: list[str] = []
    for name, value in values.items():
        kind = "counter" if name in COUNTERS else "gauge"
        full = f"sluice_relay_{name}" + ("_total" if kind == "counter" and not name.endswith("_total") else "")
        lines += [f"# HELP {full} {_HELP.get(name, name)}", f"# TYPE {full} {kind}", f"{full} {value}"]
    return "\n".join(lines) + "\n"

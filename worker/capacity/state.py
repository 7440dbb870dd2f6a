"""One read of a limited route's capacity store, decoded by ``sluice.schemas.route_view``: the reader the CLI
(``sluice routes``, ``sluice status``) and the worker's route gauges share.

Rule: read only. Every key is under the route's hash tag (one slot), so the read is a non-transactional
pipeline on a single instance or a cluster alike (TIME goes first, on its own); the clock is Redis's TIME
(the scripts' clock), so a cooldown or a permit's expiry compares as the scripts compare it. It never
expires or trims anything itself: the figures count only unexpired permits and RPM entries inside the
window, as the next script would.
"""

from __future__ import annotations

from sluice.schemas.keys import RouteKeys
from sluice.schemas.route_view import RouteView, decode_route, rpm_window_ms
from sluice.worker.redis.connect import AnyRedis

__all__ = ["read_route"]


async def read_route(redis: AnyRedis, rk: RouteKeys) -> RouteView | None:
    """The view of ``rk``'s store, or None when it has no ``limits`` (no worker with limits for it started)."""
    secs, micros = await redis.time()
    now = int(secs) * 1000 + int(micros) // 1000
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(rk.state)
    pipe.hgetall(rk.drr)
    pipe.zcount(rk.permits, f"({now}", "+inf")
    pipe.zcount(rk.reserved, f"({now}", "+inf")
    state, drr, permits, reserved = await pipe.execute()
    if not state or (b"limits" not in state and "limits" not in state):
        return None
    # The window's width comes from the limits just read.
    first = decode_route(rk.route, state, drr, in_flight=0, reserved=0, requests_last_window=0, now_ms=now)
    rpm = await redis.zcount(rk.rpm, f"({now - rpm_window_ms(first.limits)}", "+inf")
    return decode_route(
        rk.route, state, drr, in_flight=int(permits), reserved=int(reserved), requests_last_window=int(rpm), now_ms=now
    )

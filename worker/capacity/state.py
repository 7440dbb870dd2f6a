"""One read of a limited route's capacity store, decoded by ``sluice.schemas.route_view``: the reader the CLI
(``sluice routes``, ``sluice status``) and the worker's route gauges share; and one read of a tenant's budget
store (``read_budgets``: ``sluice budgets``).

Rule: read only. Every key is under the route's hash tag (one slot), so the read is a non-transactional
pipeline on a single instance or a cluster alike (TIME goes first, on its own); the clock is Redis's TIME
(the scripts' clock), so a cooldown or a permit's expiry compares as the scripts compare it. It never
expires or trims anything itself: the figures count only unexpired permits and RPM entries inside the
window, as the next script would.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from sluice.schemas.keys import BudgetKeys, RouteKeys
from sluice.schemas.route_view import RouteView, decode_route, rpm_window_ms
from sluice.worker.redis.connect import AnyRedis

__all__ = ["BudgetLine", "read_budgets", "read_route"]


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


@dataclass(frozen=True, slots=True)
class BudgetLine:
    """One budget's current window, read from its tenant's store (money in micro-units of ``currency``)."""

    name: str
    tenant: str
    currency: str
    limit: int
    spent: int
    reserved: int
    window_start: int  # unix ms (0: window = "none")
    window_end: int | None  # unix ms, None for window = "none"

    @property
    def left(self) -> int:
        return max(0, self.limit - self.spent - self.reserved)


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


async def read_budgets(redis: AnyRedis, bk: BudgetKeys) -> tuple[int, list[BudgetLine]]:
    """Redis's clock (unix ms) and the budgets of ``bk``'s tenant in their current windows (a budget shows once
    a job reserved in it). ``reserved`` still counts a reservation past its expiry until the next script on the
    store charges it."""
    secs, micros = await redis.time()
    now = int(secs) * 1000 + int(micros) // 1000
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(bk.state)
    pipe.hgetall(bk.spent)
    pipe.hgetall(bk.reserved)
    state, spent, reserved = await pipe.execute()
    spent = {_text(k): int(v) for k, v in spent.items()}
    reserved = {_text(k): int(v) for k, v in reserved.items()}
    out: list[BudgetLine] = []
    for key, raw in state.items():
        k = _text(key)
        if not k.startswith("line:"):
            continue
        line = k[len("line:") :]
        meta = msgspec.json.decode(raw)
        end = int(meta["window_end"]) if meta.get("window_end") else None
        if end is not None and end <= now:
            continue  # a past window
        out.append(
            BudgetLine(
                name=str(meta["name"]),
                tenant=bk.tenant,
                currency=str(meta.get("currency", "")),
                limit=int(meta["limit"]),
                spent=spent.get(line, 0),
                reserved=reserved.get(line, 0),
                window_start=int(line.rpartition("|")[2] or 0),
                window_end=end,
            )
        )
    return now, sorted(out, key=lambda b: b.name)

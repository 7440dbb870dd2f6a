"""The limited routes' metrics (docs/design-capacity.md B.9), read from their capacity stores.

Rule: every figure is the store's, fleet-wide, labelled with the route only (and ``reason`` / ``priority``),
never with a worker: each worker reads every limited route's store every ``INTERVAL_S`` seconds
(``sluice.worker.capacity.state``) and reports the same numbers, so a query takes one per route
(``max by (route)``), never a sum. The counters are the store's cumulative counters (observed counters: a
restarted worker reports the same total, not a new zero); the gauges are the instant of the last read. A
read that fails (Redis away) drops the figures until the next one succeeds: a stale gauge would look live.
It observes and never decides: nothing here changes an admission. Off when telemetry is off or no route has
limits.

The OpenTelemetry names and their names on ``/metrics`` (``sluice.worker.observability.metrics``: ``_total``
for counters, the unit ``s`` as ``_seconds``): ``sluice.route.admitted`` (``sluice_route_admitted_total``),
``sluice.route.refused{reason}`` (``sluice_route_refused_total``), ``sluice.route.cooldowns``
(``sluice_route_cooldowns_total``), ``sluice.route.in_flight``, ``sluice.route.waiting{priority}``,
``sluice.route.cooldown`` (``sluice_route_cooldown_seconds``). And per budget the configuration names (its
tenants' and their named keys', labelled ``budget`` and ``currency``, in the currency's units, the current
window): ``sluice.budget.amount``, ``sluice.budget.spent``, ``sluice.budget.reserved`` (same names on
``/metrics`` with ``_`` for ``.``).
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
from redis.exceptions import RedisError

from sluice.schemas.keys import PRIORITIES, Keys
from sluice.schemas.route_view import REFUSALS, RouteView
from sluice.worker.capacity.budgets import budget_name
from sluice.worker.capacity.spend import from_micro
from sluice.worker.capacity.state import BudgetLine, read_budgets, read_route
from sluice.worker.config import Config
from sluice.worker.observability.telemetry import Telemetry
from sluice.worker.redis.connect import AnyRedis

__all__ = ["BUDGET_METRICS", "INTERVAL_S", "ROUTE_METRICS", "BudgetGauges", "RouteGauges", "run_route_gauges"]

INTERVAL_S = 5.0  # how often each worker reads the stores: "every few seconds"

# Instrument name -> (kind, unit, description).
ROUTE_METRICS: dict[str, tuple[str, str, str]] = {
    "sluice.route.admitted": ("counter", "{job}", "jobs the route admitted (leases granted), fleet-wide"),
    "sluice.route.refused": ("counter", "{refusal}", "admissions the route refused, by reason, fleet-wide"),
    "sluice.route.cooldowns": ("counter", "{cooldown}", "cooldowns a 429 / 529 / overloaded started or extended"),
    "sluice.route.in_flight": ("gauge", "{permit}", "attempts holding a permit of the route now"),
    "sluice.route.waiting": ("gauge", "{job}", "jobs the route holds waiting, by priority"),
    "sluice.route.cooldown": ("gauge", "s", "seconds of cooldown left (0: none)"),
}


class RouteGauges:
    """The route instruments on ``telemetry`` and the last read of each store."""

    def __init__(self, telemetry: Telemetry, redis: AnyRedis, keys: Keys, routes: Iterable[str]) -> None:
        self.redis, self.keys = redis, keys
        self.routes = sorted(routes)
        self.views: dict[str, RouteView] = {}
        observe = {
            "sluice.route.admitted": self._admitted,
            "sluice.route.refused": self._refused,
            "sluice.route.cooldowns": self._cooldowns,
            "sluice.route.in_flight": self._in_flight,
            "sluice.route.waiting": self._waiting,
            "sluice.route.cooldown": self._cooldown,
        }
        for name, (kind, unit, description) in ROUTE_METRICS.items():
            telemetry.observe(name, unit, description, observe[name], counter=kind == "counter")

    # -- what each instrument reports, from the last read ---------------------------------------------------

    def _admitted(self) -> list[tuple[float, dict[str, str]]]:
        return [(v.counters.admitted, {"route": r}) for r, v in self.views.items()]

    def _refused(self) -> list[tuple[float, dict[str, str]]]:
        return [
            (v.counters.refused.get(x, 0), {"route": r, "reason": x}) for r, v in self.views.items() for x in REFUSALS
        ]

    def _cooldowns(self) -> list[tuple[float, dict[str, str]]]:
        return [(v.counters.cooldowns, {"route": r}) for r, v in self.views.items()]

    def _in_flight(self) -> list[tuple[float, dict[str, str]]]:
        return [(v.in_flight, {"route": r}) for r, v in self.views.items()]

    def _waiting(self) -> list[tuple[float, dict[str, str]]]:
        return [
            (sum(v.waiting.get(p, {}).values()), {"route": r, "priority": p})
            for r, v in self.views.items()
            for p in PRIORITIES
        ]

    def _cooldown(self) -> list[tuple[float, dict[str, str]]]:
        return [(v.cooldown_remaining_ms / 1000, {"route": r}) for r, v in self.views.items()]

    # -- reading ------------------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every route's store once; on a Redis failure, report nothing until a read succeeds."""
        views: dict[str, RouteView] = {}
        try:
            for name in self.routes:
                view = await read_route(self.redis, self.keys.route(name))
                if view is not None:
                    views[name] = view
        except (RedisError, OSError, RuntimeError, AttributeError):  # redis-py's resets too, as the worker's loops
            views = {}
        self.views = views

    async def run(self, interval_s: float | None = None) -> None:
        while True:
            await self.refresh()
            await anyio.sleep(INTERVAL_S if interval_s is None else interval_s)


async def run_route_gauges(telemetry: Telemetry, redis: AnyRedis, keys: Keys, config: Config) -> None:
    """The worker's route metrics, for as long as it runs (returns at once when there is nothing to report)."""
    routes = [name for name, r in config.routes.items() if r.limited]
    if not telemetry.enabled or not (routes or any(t != "*" for t in config.budgets)):
        return
    async with anyio.create_task_group() as tg:
        if routes:
            tg.start_soon(RouteGauges(telemetry, redis, keys, routes).run)
        if any(t != "*" for t in config.budgets):
            tg.start_soon(BudgetGauges(telemetry, redis, keys, config).run)


# Instrument name -> (kind, unit, description): each budget's current window (docs/capacity.md#budgets).
BUDGET_METRICS: dict[str, tuple[str, str, str]] = {
    "sluice.budget.amount": ("gauge", "{currency}", "the budget's amount in its currency, fleet-wide"),
    "sluice.budget.spent": ("gauge", "{currency}", "money settled in the budget's current window, fleet-wide"),
    "sluice.budget.reserved": ("gauge", "{currency}", "worst cases held by attempts running now, fleet-wide"),
}


class BudgetGauges:
    """The budget instruments on ``telemetry`` and the last read of each named tenant's store. Only the tenants
    the configuration names and the keys it names are reported (``"*"``'s budgets would be one series per
    tenant or key ever seen: ``sluice budgets`` shows those)."""

    def __init__(self, telemetry: Telemetry, redis: AnyRedis, keys: Keys, config: Config) -> None:
        self.redis, self.keys = redis, keys
        self.tenants = sorted(t for t in config.budgets if t != "*")
        self.named = {budget_name(t, k) for t in self.tenants for k in (None, *config.budgets[t].keys) if k != "*"}
        self.lines: list[BudgetLine] = []
        observe = {
            "sluice.budget.amount": lambda: self._series("limit"),
            "sluice.budget.spent": lambda: self._series("spent"),
            "sluice.budget.reserved": lambda: self._series("reserved"),
        }
        for name, (_, unit, description) in BUDGET_METRICS.items():
            telemetry.observe(name, unit, description, observe[name])

    def _series(self, field: str) -> list[tuple[float, dict[str, str]]]:
        return [
            (float(from_micro(getattr(b, field))), {"budget": b.name, "currency": b.currency})
            for b in self.lines
            if b.name in self.named
        ]

    async def refresh(self) -> None:
        """Read every named tenant's store once; on a Redis failure, report nothing until a read succeeds."""
        lines: list[BudgetLine] = []
        try:
            for tenant in self.tenants:
                lines += (await read_budgets(self.redis, self.keys.budget(tenant)))[1]
        except (RedisError, OSError):
            lines = []
        self.lines = lines

    async def run(self, interval_s: float | None = None) -> None:
        while True:
            await self.refresh()
            await anyio.sleep(INTERVAL_S if interval_s is None else interval_s)

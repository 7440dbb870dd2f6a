"""Budgets in money: which budgets a job falls under, the window each is counted in, and a job's worst case.

Rule: a job falls under its tenant's budget (``[budgets.<tenant>]``, else ``[budgets."*"]``, one budget per
tenant) when its route is among that budget's ``routes`` (none listed: every route), and under one of its
key's budgets nested in it (``keys.<budget_key>``, else ``keys."*"``, one budget per key; a key named by
neither has only the tenant's). It runs only when every budget it falls under has room. A budget counts
its spend per window: the calendar day or month in its ``time_zone`` (``"none"``: one window forever), and
its store keeps a window's figures through the window after it (``removable_from``).
The worst case held at admission is every input token at the dearest input price (input, cache read, cache
write) plus ``max_tokens`` at the dearer of the output and reasoning prices, so the settled cost of the
reported usage can never pass it. Pure but for the time zone database.
"""

from __future__ import annotations

import calendar
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import TYPE_CHECKING

from sluice.normalizer.pricing import PriceError, Prices

if TYPE_CHECKING:
    from sluice.worker.config import Budget, Config

__all__ = [
    "MAX_AMOUNT",
    "BudgetRef",
    "amount_of",
    "budget_name",
    "budgets_for",
    "removable_from",
    "window_bounds",
    "worst_case",
    "zone",
]

_MILLION = Decimal(1_000_000)
# Micro-units summed in Lua (doubles): exact integers up to 2**53, about 9.007e9 units of the currency.
MAX_AMOUNT = Decimal(9_000_000_000)


@dataclass(frozen=True, slots=True)
class BudgetRef:
    """One budget a job falls under: ``name`` as the configuration says it (``budgets.acme``,
    ``budgets.acme.keys.p1``), made concrete for the job's tenant and key (``*`` replaced)."""

    name: str
    tenant: str
    key: str | None  # None: the tenant's own budget
    budget: Budget


def _decimal(value: str | float | int) -> Decimal:
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        raise PriceError(f"must be a decimal number, not {value!r}") from None
    if not d.is_finite():
        raise PriceError(f"must be a decimal number, not {value!r}")
    return d


def amount_of(budget: Budget) -> Decimal:
    """The budget's amount as a decimal. Raises ``PriceError`` (the message follows the key) for an amount
    that does not parse or is negative."""
    if budget.amount is None:
        raise PriceError("is required")
    d = _decimal(budget.amount)
    if d < 0:
        raise PriceError(f"= {budget.amount}: must be at least 0")
    if d > MAX_AMOUNT:
        raise PriceError(f"= {budget.amount}: must be at most {MAX_AMOUNT} (the store counts micro-units exactly)")
    return d


@lru_cache(maxsize=64)
def zone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA time zone ``name``. Raises ``ValueError`` with one line when it is unknown."""
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name such as 'UTC' or 'Europe/Berlin')") from None


def _part(name: str) -> str:
    plain = name and all(c.isalnum() or c in "_.-" for c in name) and name.isascii()
    return name if plain else repr(name)


def budget_name(tenant: str, key: str | None = None) -> str:
    """How a budget is named in statuses, refusals and ``sluice budgets``."""
    base = f"budgets.{_part(tenant)}"
    return base if key is None else f"{base}.keys.{_part(key)}"


def budgets_for(config: Config, tenant: str, key: str | None, route: str) -> list[BudgetRef]:
    """The budgets a job of ``tenant`` carrying ``key`` on its own ``route`` falls under, outermost first."""
    tb = config.budgets.get(tenant) or config.budgets.get("*")
    if tb is None or (tb.routes is not None and route not in tb.routes):
        return []
    out = [BudgetRef(budget_name(tenant), tenant, None, tb)]
    if key is not None and (kb := tb.keys.get(key) or tb.keys.get("*")) is not None:
        out.append(BudgetRef(budget_name(tenant, key), tenant, key, kb))
    return out


def window_bounds(budget: Budget, now_ms: int) -> tuple[int, int | None]:
    """The unix-ms start and end of the window ``now_ms`` falls in (end None: ``window = "none"``)."""
    if budget.window == "none":
        return 0, None
    tz = zone(budget.time_zone)
    local = datetime.fromtimestamp(now_ms / 1000, UTC).astimezone(tz)
    if budget.window == "day":
        start = datetime(local.year, local.month, local.day, tzinfo=tz)
        nxt = start.date() + timedelta(days=1)
        end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz)
    else:
        start = datetime(local.year, local.month, 1, tzinfo=tz)
        days = calendar.monthrange(local.year, local.month)[1]
        nxt = start.date() + timedelta(days=days)
        end = datetime(nxt.year, nxt.month, 1, tzinfo=tz)
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


def removable_from(budget: Budget, window_end: int | None) -> int | None:
    """When the figures of the window ending at ``window_end`` may go: the end of the window after it, so a
    window stays readable through the next one (None: ``window = "none"``, kept forever)."""
    return None if window_end is None else window_bounds(budget, window_end)[1]


def worst_case(prices: Prices, input_tokens: int, max_tokens: int) -> Decimal:
    """The most a request of ``input_tokens`` (an estimate) and ``max_tokens`` can cost under ``prices``."""
    p_in = _decimal(prices.input)
    dearest_in = max([p_in, *(_decimal(v) for v in (prices.cache_read, prices.cache_write) if v is not None)])
    p_out = _decimal(prices.output)
    dearest_out = max(p_out, _decimal(prices.reasoning)) if prices.reasoning is not None else p_out
    return (input_tokens * dearest_in + max_tokens * dearest_out) / _MILLION

"""A limited route's capacity store as an operator reads it (docs/design-capacity.md B.9): the decoding of what
the capacity scripts (``sluice.worker.capacity.scripts``) write into ``RouteKeys``.

Rule: pure. ``decode_route`` takes the raw replies of one read (``state`` and ``drr`` hashes, the counts of the
live permits, reservations and RPM window entries, Redis's clock) and returns a typed ``RouteView``; it never
reads Redis or a clock itself, so the CLI, the client and the worker's gauges show the same figures. The live
reason (``RouteView.live_reason``) applies the scripts' refusal order (cooldown, concurrency, rate, tokens) to
that read: what an admission at that instant would be refused on, or ``""``. A field the store lacks reads as
0 / empty, so a store written by a later version still decodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

import msgspec

from sluice.schemas.keys import PRIORITIES

__all__ = [
    "REFUSALS",
    "Refusal",
    "RouteCounters",
    "RouteLimits",
    "RouteView",
    "TenantLimits",
    "decode_route",
    "rpm_window_ms",
]

Refusal = Literal["cooldown", "concurrency", "rate", "tokens"]
REFUSALS: tuple[Refusal, ...] = get_args(Refusal)  # the scripts' refusal order, and the counters' names


class TenantLimits(msgspec.Struct, frozen=True, kw_only=True):
    weight: int = 1  # DRR quantum: turns per round
    max_concurrency: int = 0  # permits at once on this route; 0: no cap


class RouteLimits(msgspec.Struct, frozen=True, kw_only=True):
    """``state.limits`` (the JSON the fleet agreed on), with the configuration's key names; 0 = no limit."""

    max_concurrency: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    rate_window_margin_ms: int = 0
    cooldown_min_ms: int = 0
    cooldown_max_ms: int = 0
    cooldown_base_ms: int = 0
    tenants: dict[str, TenantLimits] = {}


class RouteCounters(msgspec.Struct, frozen=True, kw_only=True):
    """The store's cumulative counters (fleet-wide, since the store was created)."""

    admitted: int = 0  # leases granted (OFFER admitted at once, or ADMIT)
    parked: int = 0  # jobs that had to wait
    refused: dict[str, int] = {}  # reason (REFUSALS) -> refusals counted by OFFER / ADMIT / ACQUIRE
    expired: int = 0  # leases that expired and went back to their queue (a worker lost)
    cooldowns: int = 0  # cooldowns started or extended by a 429 / 529 / overloaded (``provider_429``)


class RouteView(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    limits: RouteLimits
    in_flight: int  # live permits (ZCARD of the unexpired ``permits``), fallback attempts of other routes too
    reserved: int  # places kept for retries refused on concurrency
    requests_last_window: int  # RPM window entries still inside the window
    tokens_last_window: int  # ``tpm_sum``
    waiting: dict[str, dict[str, int]]  # priority -> tenant -> waiting jobs (the ``n:`` fields)
    tenants_in_flight: dict[str, int]  # tenant -> leases held (the ``f:`` fields), zeros left out
    cooldown_until: int  # unix ms; 0: never
    cooldown_remaining_ms: int  # from ``now_ms``; 0: not in cooldown
    cooldown_reason: str
    cooldown_streak: int
    counters: RouteCounters
    live_reason: Literal["", "cooldown", "concurrency", "rate", "tokens"]
    now_ms: int  # Redis's clock at the read

    @property
    def waiting_total(self) -> int:
        return sum(n for by_tenant in self.waiting.values() for n in by_tenant.values())


_LIMIT_KEYS = {
    "c": "max_concurrency",
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "margin": "rate_window_margin_ms",
    "cmin": "cooldown_min_ms",
    "cmax": "cooldown_max_ms",
    "cbase": "cooldown_base_ms",
}
_DEFAULT_MARGIN_MS = 1000  # the scripts' default when the limits carry none


class _StoredTenant(msgspec.Struct, frozen=True):
    w: int = 1
    c: int = 0


class _StoredLimits(msgspec.Struct, frozen=True):
    c: int = 0
    rpm: int = 0
    tpm: int = 0
    margin: int = _DEFAULT_MARGIN_MS
    cmin: int = 0
    cmax: int = 0
    cbase: int = 0
    tenants: dict[str, _StoredTenant] = {}


_DECODE_LIMITS = msgspec.json.Decoder(_StoredLimits)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _int(v: bytes | str | None) -> int:
    if v is None:
        return 0
    try:
        return int(float(_text(v)))
    except ValueError:
        return 0


def _limits(raw: bytes | str | None) -> RouteLimits:
    stored = _DECODE_LIMITS.decode(raw) if raw else _StoredLimits()
    return RouteLimits(
        **{name: getattr(stored, short) for short, name in _LIMIT_KEYS.items()},
        tenants={t: TenantLimits(weight=c.w, max_concurrency=c.c) for t, c in sorted(stored.tenants.items())},
    )


def rpm_window_ms(limits: RouteLimits) -> int:
    """The RPM / TPM window the scripts count in: a minute plus the margin (B.3)."""
    return 60_000 + limits.rate_window_margin_ms


def decode_route(
    route: str,
    state: Mapping[bytes | str, bytes | str],
    drr: Mapping[bytes | str, bytes | str],
    *,
    in_flight: int,
    reserved: int,
    requests_last_window: int,
    now_ms: int,
) -> RouteView:
    """The view of one read of ``route``'s store. ``state`` / ``drr``: HGETALL of those hashes;
    ``in_flight`` / ``reserved``: members of ``permits`` / ``reserved`` whose expiry is after ``now_ms``;
    ``requests_last_window``: members of ``rpm`` inside ``rpm_window_ms`` before ``now_ms``."""
    s = {_text(k): v for k, v in state.items()}
    limits = _limits(s.get("limits"))
    waiting: dict[str, dict[str, int]] = {p: {} for p in PRIORITIES}
    tenants_in_flight: dict[str, int] = {}
    for key, value in sorted((_text(k), v) for k, v in drr.items()):
        kind, _, rest = key.partition(":")
        n = _int(value)
        if kind == "n" and n > 0:
            prio, _, tenant = rest.partition(":")
            if prio in waiting:
                waiting[prio][tenant] = n
        elif kind == "f" and n > 0:
            tenants_in_flight[rest] = n
    cooldown_until = _int(s.get("cooldown_until"))
    tokens = _int(s.get("tpm_sum"))
    counters = RouteCounters(
        admitted=_int(s.get("admitted")),
        parked=_int(s.get("parked")),
        refused={r: _int(s.get(f"refused_{r}")) for r in REFUSALS},
        expired=_int(s.get("expired")),
        cooldowns=_int(s.get("provider_429")),
    )
    reason: Literal["", "cooldown", "concurrency", "rate", "tokens"] = ""
    if cooldown_until > now_ms:
        reason = "cooldown"
    elif limits.max_concurrency and in_flight + reserved >= limits.max_concurrency:
        reason = "concurrency"
    elif limits.requests_per_minute and requests_last_window >= limits.requests_per_minute:
        reason = "rate"
    elif limits.tokens_per_minute and tokens >= limits.tokens_per_minute:
        reason = "tokens"
    return RouteView(
        route=route,
        limits=limits,
        in_flight=in_flight,
        reserved=reserved,
        requests_last_window=requests_last_window,
        tokens_last_window=tokens,
        waiting=waiting,
        tenants_in_flight=tenants_in_flight,
        cooldown_until=cooldown_until,
        cooldown_remaining_ms=max(0, cooldown_until - now_ms),
        cooldown_reason=_text(s.get("cooldown_reason", "")),
        cooldown_streak=_int(s.get("cooldown_streak")),
        counters=counters,
        live_reason=reason,
        now_ms=now_ms,
    )

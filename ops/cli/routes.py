"""``sluice routes``: the capacity of each limited route of a key prefix (docs/design-capacity.md B.9), and the
live reason ``sluice status`` adds to a waiting job.

Rule: read only, from the routes' stores (``sluice.worker.capacity.state``, decoded by
``sluice.schemas.route_view``); the routes shown are those the prefix's workers registered, those the config
file limits and those with a store under the prefix (a SCAN: the stores outlive their workers), or the
``--route`` names given. A prefix with nothing under it (no worker ever registered, no store) is unusable
input and exits 2 naming the prefix and the URL; a prefix whose routes have no limits says so and exits 0
(``--json``: an empty ``routes`` list); a ``--route`` without a store exits 2 naming it.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

import msgspec

from sluice.cli.exits import Exit
from sluice.cli.requests import CommandError, config_from_args, redis_args, run_with_client
from sluice.client import SluiceClient
from sluice.schemas.route_view import REFUSALS, RouteView
from sluice.worker.capacity.state import read_route
from sluice.worker.pipeline.membership import Member
from sluice.worker.redis.connect import safe_url

__all__ = ["cmd_routes", "configure_routes", "live_route", "render_route"]

_DECODE_MEMBER = msgspec.json.Decoder(Member)


def configure_routes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--route", action="append", default=[], metavar="NAME", help="show only this route (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON document: {prefix, now_ms, routes: [...]}")
    redis_args(p)


def _tenant(name: str) -> str:
    return name if name else "(no tenant)"


def _limit(n: int) -> str:
    return str(n) if n else "none"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def render_route(v: RouteView) -> str:
    """The text block of one route (the lines ``sluice routes`` prints)."""
    lim = v.limits
    lines = [
        v.route,
        f"  limits       max_concurrency {_limit(lim.max_concurrency)}, requests_per_minute "
        f"{_limit(lim.requests_per_minute)}, tokens_per_minute {_limit(lim.tokens_per_minute)}",
    ]
    if lim.tenants:
        parts = []
        for name, t in lim.tenants.items():
            cap = f" max_concurrency {t.max_concurrency}" if t.max_concurrency else ""
            parts.append(f"{name} weight {t.weight}{cap}")
        lines.append(f"  tenants      {'; '.join(parts)}")
    of_c = f" of {lim.max_concurrency}" if lim.max_concurrency else ""
    lines.append(f"  in flight    {v.in_flight}{of_c} (reserved {v.reserved})")
    by_tenant = ", ".join(f"{_tenant(t)} {n}" for t, n in v.tenants_in_flight.items())
    if by_tenant:
        lines.append(f"  held by      {by_tenant}")
    of_r = f" of {lim.requests_per_minute}" if lim.requests_per_minute else ""
    of_t = f" of {lim.tokens_per_minute}" if lim.tokens_per_minute else ""
    lines.append(f"  last minute  {v.requests_last_window}{of_r} requests, {v.tokens_last_window}{of_t} tokens")
    prios = []
    for prio, tenants in v.waiting.items():
        total = sum(tenants.values())
        detail = f" ({', '.join(f'{_tenant(t)} {n}' for t, n in tenants.items())})" if tenants else ""
        prios.append(f"{prio} {total}{detail}")
    lines.append(f"  waiting      {v.waiting_total}: {', '.join(prios)}")
    if v.cooldown_remaining_ms:
        lines.append(
            f"  cooldown     until {_iso(v.cooldown_until)} ({v.cooldown_reason or 'unknown'}, "
            f"streak {v.cooldown_streak})"
        )
    else:
        lines.append("  cooldown     none")
    c = v.counters
    lines.append(f"  admitted     {c.admitted}")
    lines.append(f"  parked       {c.parked}")
    lines.append(f"  refused      {', '.join(f'{r} {c.refused.get(r, 0)}' for r in REFUSALS)}")
    lines.append(f"  expired      {c.expired}")
    lines.append(f"  cooldowns    {c.cooldowns}")
    lines.append(f"  now          {'refusing: ' + v.live_reason if v.live_reason else 'admitting'}")
    return "\n".join(lines)


def _doc(v: RouteView) -> dict[str, object]:
    doc = msgspec.to_builtins(v)
    doc["waiting_total"] = v.waiting_total
    del doc["now_ms"]  # one clock for the document, at its top
    return doc  # type: ignore[no-any-return]


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


async def _stored(c: SluiceClient) -> set[str]:
    """The routes that have a capacity store under the prefix (SCAN for their ``state`` keys: the stores
    outlive the workers that wrote them)."""
    head, tail = f"{c.keys.prefix}:{{cap:", "}:state"
    names: set[str] = set()
    async for key in c.redis.scan_iter(match=_glob_escape(head) + "*" + _glob_escape(tail), count=1000):
        k = key.decode() if isinstance(key, bytes) else key
        if k.startswith(head) and k.endswith(tail):
            names.add(k[len(head) : -len(tail)])
    return names


async def _registered(c: SluiceClient) -> list[str] | None:
    """The routes the prefix's workers registered (live or not), or None when none ever did."""
    raw = await c.redis.hgetall(c.keys.workers)
    if not raw:
        return None
    names: set[str] = set()
    for value in raw.values():
        try:
            names.update(_DECODE_MEMBER.decode(value).routes)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue  # not a member record
    return sorted(names)


def cmd_routes(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    configured = [name for name, r in config.routes.items() if r.limited]
    where = f"key prefix {config.key_prefix!r} at {safe_url(config.redis_url)}"

    async def go(c: SluiceClient) -> int:
        registered = await _registered(c)
        names = sorted(set(args.route) if args.route else {*(registered or ()), *configured, *await _stored(c)})
        views: list[RouteView] = []
        for name in names:
            view = await read_route(c.redis, c.keys.route(name))
            if view is not None:
                views.append(view)
            elif args.route:
                raise CommandError(f"route {name!r} has no capacity store under {where} (a route without limits?)")
        if not views and registered is None:
            raise CommandError(
                f"nothing under {where}: no worker ever registered and no route store; check --key-prefix / "
                "--redis-url against the workers' configuration"
            )
        if args.json:
            now = views[0].now_ms if views else None
            doc = {"prefix": c.keys.prefix, "now_ms": now, "routes": [_doc(v) for v in views]}
            sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(doc)) + b"\n")
        elif views:
            sys.stdout.write("\n\n".join(render_route(v) for v in views) + "\n")
        if not views:
            served = ", ".join(names) or "none"
            print(f"sluice routes: no route of {where} has capacity limits (routes: {served})", file=sys.stderr)
        sys.stdout.flush()
        return Exit.OK

    return run_with_client(args, go)


async def live_route(c: SluiceClient, route: str) -> dict[str, object] | None:
    """What ``sluice status`` shows beside a waiting job's ``waiting_on``: the route's state now."""
    view = await read_route(c.redis, c.keys.route(route))
    if view is None:
        return None
    return {
        "live_reason": view.live_reason,
        "in_flight": view.in_flight,
        "max_concurrency": view.limits.max_concurrency,
        "requests_last_window": view.requests_last_window,
        "requests_per_minute": view.limits.requests_per_minute,
        "waiting": view.waiting_total,
        "cooldown_until": view.cooldown_until,
        "now_ms": view.now_ms,
    }

"""``sluice budgets``: each budget's current window of a key prefix: amount, spent, reserved, left, window end
(docs/capacity.md#budgets).

Rule: read only, from the tenants' budget stores (``sluice.worker.capacity.state.read_budgets``), found by SCAN
(a store outlives its workers) or named with ``--tenant``; a budget shows once a job reserved in it. Money is
printed as decimals of its currency (the store counts whole micro-units). Exit 0, with a line on stderr when
there is no budget store under the prefix.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

import msgspec

from sluice.cli.exits import Exit
from sluice.cli.requests import config_from_args, redis_args, run_with_client
from sluice.client import SluiceClient
from sluice.normalizer.pricing import format_cost
from sluice.worker.capacity.spend import from_micro
from sluice.worker.capacity.state import BudgetLine, read_budgets
from sluice.worker.redis.connect import safe_url

__all__ = ["cmd_budgets", "configure_budgets", "render_budget"]


def configure_budgets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", action="append", default=[], metavar="NAME", help="show only this tenant (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON document: {prefix, now_ms, budgets: [...]}")
    redis_args(p)


def _money(units: int) -> str:
    return format_cost(from_micro(units))


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_budget(b: BudgetLine) -> str:
    ends = "none (never resets)" if b.window_end is None else _iso(b.window_end)
    return "\n".join(
        [
            b.name,
            f"  amount       {_money(b.limit)} {b.currency}",
            f"  spent        {_money(b.spent)}",
            f"  reserved     {_money(b.reserved)}",
            f"  left         {_money(b.left)}",
            f"  window end   {ends}",
        ]
    )


def _doc(b: BudgetLine) -> dict[str, object]:
    return {
        "name": b.name,
        "tenant": b.tenant,
        "currency": b.currency,
        "amount": _money(b.limit),
        "spent": _money(b.spent),
        "reserved": _money(b.reserved),
        "left": _money(b.left),
        "window_start_ms": b.window_start,
        "window_end_ms": b.window_end,
    }


async def _tenants(c: SluiceClient) -> list[str]:
    """The tenants with a budget store under the prefix (SCAN for their ``state`` keys)."""
    head, tail = f"{c.keys.prefix}:{{budget:", "}:state"
    escaped = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in head)
    found: set[str] = set()
    async for key in c.redis.scan_iter(match=escaped + "*" + tail, count=1000):
        k = key.decode() if isinstance(key, bytes) else key
        if k.startswith(head) and k.endswith(tail):
            try:
                found.add(bytes.fromhex(k[len(head) : -len(tail)]).decode())
            except ValueError:
                continue  # not a store of ours
    return sorted(found)


def cmd_budgets(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    where = f"key prefix {config.key_prefix!r} at {safe_url(config.redis_url)}"

    async def go(c: SluiceClient) -> int:
        tenants = sorted(set(args.tenant)) if args.tenant else await _tenants(c)
        now: int | None = None
        lines: list[BudgetLine] = []
        for tenant in tenants:
            now, found = await read_budgets(c.redis, c.keys.budget(tenant))
            lines += found
        if args.json:
            doc = {"prefix": c.keys.prefix, "now_ms": now, "budgets": [_doc(b) for b in lines]}
            sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(doc)) + b"\n")
        elif lines:
            sys.stdout.write("\n\n".join(render_budget(b) for b in lines) + "\n")
        if not lines:
            print(f"sluice budgets: no budget has been reserved in under {where}", file=sys.stderr)
        sys.stdout.flush()
        return Exit.OK

    return run_with_client(args, go)

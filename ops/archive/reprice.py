"""``sluice reprice``: every archived request's cost recomputed from its archived usage under another price
table (a corrected price, a negotiated discount), written beside the original, never over it.

Rule: the price file is TOML in the configuration's own form (``[prices.<route>]`` tables, optional
``prices_version``; default: a hash of the tables), checked like the configuration's. Each index row of the
range is proven against its object first (``read_archived``); the cost is recomputed from the usage the final
attempt's archived events report, with that attempt's route and dialect, and written to
``reprice/<prices_version>/date=<day>/<request>.a<attempt>.json`` (the original cost, currency and
prices_version kept in it), so ``index/`` is never touched and a second run with the same table writes the
same bytes. A report by day and route says what changed; exit 0, 1 when an archived request could not be
repriced (damaged), 2 for a bad price file or archive URL.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from decimal import Decimal

import msgspec

from sluice.archive.proof import final_usage
from sluice.archive.reader import index_rows, read_archived
from sluice.archive.record import ArchiveCorrupt, IndexRow
from sluice.normalizer.pricing import PriceError, Prices, check_prices, cost_of, format_cost, prices_version
from sluice.schemas.events import Usage
from sluice.worker.files import UnreadableFile, read_input

__all__ = ["PriceFile", "Repriced", "configure_parser", "load_prices", "reprice_name", "repriced", "run_from_args"]

_ENC = msgspec.json.Encoder(order="deterministic")


class PriceFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prices: dict[str, Prices] = {}
    prices_version: str = ""


class Repriced(msgspec.Struct, frozen=True, kw_only=True):
    """One request's cost under another table, beside its original (``original_*``: the index row's)."""

    request_id: str
    attempt: int
    date: str
    route: str
    model: str
    tenant: str
    budgets: list[str]
    usage_reported: bool
    cost: str  # "" when the table has no price for the route or no usage was reported
    currency: str
    prices_version: str
    original_cost: str
    original_currency: str
    original_prices_version: str


def load_prices(path: str) -> tuple[dict[str, Prices], str]:
    """The file's tables and their version. Raises ``ValueError`` with one line naming the key."""
    try:
        doc = msgspec.toml.decode(read_input(path, "price file"), type=PriceFile)
    except UnreadableFile as exc:
        raise ValueError(str(exc)) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path}: not a price file ({exc})") from None
    if not doc.prices:
        raise ValueError(f"{path}: no [prices.<route>] table")
    for route, p in doc.prices.items():
        try:
            check_prices(f"prices.{route}", p)
        except PriceError as exc:
            raise ValueError(str(exc)) from None
    return doc.prices, doc.prices_version or prices_version(_ENC.encode(doc.prices))


def reprice_name(version: str, row: IndexRow) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in version)
    return f"reprice/{safe}/date={row.date}/{row.request_id}.a{row.attempt}.json"


def repriced(
    row: IndexRow, route: str, used: tuple[Usage | None, str] | None, tables: dict[str, Prices], version: str
) -> Repriced:
    usage, dialect = used if used is not None else (None, "")
    prices = tables.get(route)
    cost = cost_of(usage, prices, dialect) if prices is not None else None
    return Repriced(
        request_id=row.request_id,
        attempt=row.attempt,
        date=row.date,
        route=route,
        model=row.model,
        tenant=row.tenant,
        budgets=row.budgets,
        usage_reported=usage is not None,
        cost="" if cost is None else format_cost(cost),
        currency=prices.currency if prices is not None and cost is not None else "",
        prices_version=version if cost is not None else "",
        original_cost=row.cost,
        original_currency=row.currency,
        original_prices_version=row.prices_version,
    )


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archive", metavar="URL", required=True, help="the archive: a directory or s3://bucket/prefix")
    p.add_argument(
        "--prices", metavar="FILE", required=True, help="TOML with [prices.<route>] tables (and prices_version)"
    )
    p.add_argument("--since", metavar="DURATION", default="30d", help="the requests finished since then (default 30d)")


def _dec(text: str) -> Decimal:
    return Decimal(text) if text else Decimal(0)


def run_from_args(args: argparse.Namespace) -> int:
    import anyio

    from sluice.archive.cli import destination_from
    from sluice.archive.store import DestinationError
    from sluice.cli.audit import parse_duration
    from sluice.cli.requests import CommandError

    try:
        since_ms = parse_duration(args.since)
    except ValueError as exc:
        raise CommandError(f"--since: {exc}") from None
    try:
        tables, version = load_prices(args.prices)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    dest = destination_from(args.archive)

    async def go() -> int:
        now = int(time.time() * 1000)
        rows, bad = await index_rows(dest, now - since_ms, now)
        # (day, route) -> [requests, repriced, original sum, new sum]
        report: dict[tuple[str, str], list[Decimal]] = defaultdict(lambda: [Decimal(0)] * 4)
        damaged = len(bad)
        for name in bad:
            print(f"ALTERED   {name}  (an index row that does not decode)")
        for row in rows:
            try:
                req = await read_archived(dest, row.request_id)
            except ArchiveCorrupt as exc:
                damaged += 1
                print(f"{exc.kind.upper():<9} {row.request_id}  {exc.detail}")
                continue
            route = req.status_text.get("attempt_route") or row.route
            doc = repriced(row, route, final_usage(req), tables, version)
            await dest.put(reprice_name(version, row), _ENC.encode(doc) + b"\n")
            line = report[(row.date, route)]
            line[0] += 1
            line[1] += 1 if doc.cost else 0
            line[2] += _dec(row.cost)
            line[3] += _dec(doc.cost)
        print(f"repriced under {version} ({len(rows)} archived request(s) finished in the last {args.since}):")
        print(
            f"{'date':<10}  {'route':<16}  {'requests':>8}  {'priced':>6}  {'original':>14}  {'repriced':>14}  change"
        )
        for (day, route), (n, priced, old, new) in sorted(report.items()):
            change = format_cost(new - old) if new >= old else "-" + format_cost(old - new)
            print(
                f"{day:<10}  {route:<16}  {int(n):>8}  {int(priced):>6}  {format_cost(old):>14}  "
                f"{format_cost(new):>14}  {'+' if new > old else ''}{change}"
            )
        if damaged:
            print(f"{damaged} damaged archive object(s) not repriced")
        return 1 if damaged else 0

    try:
        return anyio.run(go)
    except DestinationError as exc:
        raise CommandError(str(exc)) from None

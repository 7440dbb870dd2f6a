"""``sluice archive``: run an archiver, print its lag (``--status``), or compare Redis with the archive
(``--verify``).

Rule: the destination is ``--to`` (or ``$SLUICE_ARCHIVE_URL``): a directory path (the default kind, no
extras) or an object-store URL; credentials come from the store's own chain, never from flags or the
config. ``--once`` exits 2 when one step (a write, a read, an ack) failed ``ONCE_TRIES`` times in a row, naming
its last cause; ``--status`` exits 1 when the lag is past half of ``retention_seconds`` (``--config``'s, else
the live workers' own, which they record with their heartbeat; refused with neither); ``--verify`` exits 1
when an archived request differs from what Redis still holds or an archive object or its index row is
damaged (the row proven against the object, ``sluice.archive.proof``; a cost recomputed with ``--config``'s
route price tables when its prices_version names them).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING, Any

from sluice.archive.archiver import DEFAULT_GROUP, ONCE_TRIES, ArchiveGaveUp, Archiver, fetch_request
from sluice.archive.proof import RouteTables
from sluice.archive.reader import read_archived, same_request
from sluice.archive.record import ArchiveCorrupt
from sluice.archive.store import Destination, DestinationError, open_destination
from sluice.client.terminals import Terminal

if TYPE_CHECKING:
    from sluice.worker.config import Config

__all__ = ["configure_parser", "destination_from", "run_from_args"]


def configure_parser(p: argparse.ArgumentParser) -> None:
    from sluice.cli.requests import redis_args

    p.add_argument(
        "--to",
        metavar="URL",
        default=None,
        help="a directory, or s3://, gs://, az://, file:// (the archive extra); default $SLUICE_ARCHIVE_URL",
    )
    p.add_argument("--group", default=DEFAULT_GROUP, help=f"the archivers' consumer group (default {DEFAULT_GROUP})")
    p.add_argument("--consumer", default=None, help="this archiver's name in the group (default archive-<host>-<pid>)")
    p.add_argument("--concurrency", type=int, default=8, help="requests archived at once (default 8)")
    p.add_argument(
        "--claim-idle-ms",
        type=int,
        default=60_000,
        help="take over entries another archiver left pending this long (default 60000)",
    )
    p.add_argument("--lag-interval", type=float, default=30.0, help="seconds between lag log lines (default 30)")
    mode = p.add_mutually_exclusive_group()
    once_help = f"archive until the group has nothing unacknowledged, then exit (2 once a step failed {ONCE_TRIES}×)"
    mode.add_argument("--once", action="store_true", help=once_help)
    mode.add_argument(
        "--status",
        action="store_true",
        help="print the group's lag per shard against retention_seconds (--config's, else the live workers' "
        "own; refused with neither); exit 1 past half of it",
    )
    mode.add_argument(
        "--verify",
        action="store_true",
        help="compare every request Redis still holds with the archive; exit 1 on a difference, a damaged object "
        "or an index row its object does not prove",
    )
    redis_args(p)


def destination_from(url: str | None) -> Destination:
    from sluice.cli.requests import CommandError

    target = url or os.environ.get("SLUICE_ARCHIVE_URL", "")
    if not target:
        raise CommandError("give --to DIRECTORY|URL (or set SLUICE_ARCHIVE_URL)")
    try:
        return open_destination(target)
    except DestinationError as exc:
        raise CommandError(str(exc)) from None


def run_from_args(args: argparse.Namespace) -> int:
    from sluice.cli.requests import CommandError, config_from_args, run_with_client

    config = config_from_args(args)
    retention = config.retention_seconds
    if args.status:
        named = getattr(args, "config", None) or os.environ.get("SLUICE_CONFIG")
        return run_with_client(args, lambda c: _status(c, args.group, config, named))
    dest = destination_from(args.to)
    if args.verify:
        from sluice.worker.cost import route_tables

        tables = route_tables(config)
        return run_with_client(args, lambda c: _verify(c, dest, tables))
    if args.concurrency < 1:
        raise CommandError("--concurrency must be at least 1")

    async def go(c: Any) -> int:
        archiver = Archiver(
            c,
            dest,
            group=args.group,
            consumer=args.consumer,
            concurrency=args.concurrency,
            claim_idle_ms=args.claim_idle_ms,
            retention_seconds=retention,
            lag_interval=args.lag_interval,
            max_tries=ONCE_TRIES if args.once else None,
        )
        try:
            st = await archiver.run(once=args.once)
        except ArchiveGaveUp as exc:
            raise CommandError(str(exc)) from None
        print(
            f"archived {st.archived} request(s) ({st.bytes} bytes, {st.events} entries); "
            f"{st.already} already archived, "
            f"{st.lost} lost (expired before archiving), {st.running} running again; "
            f"{st.destination_errors} destination error(s) retried"
        )
        return 1 if st.lost else 0

    return run_with_client(args, go)


async def _retention(c: Any, config: Config, named: str | None) -> tuple[int, str]:
    """The retention_seconds the lag is held against, and where it came from: the configuration file when
    one is named, else the live workers' own (they record it with their heartbeat); refused when neither
    says, since the built-in default may not be what the workers run with."""
    from sluice.cli.requests import CommandError
    from sluice.worker.pipeline.membership import live_members

    if named:
        return config.retention_seconds, f"from {named}"
    members = await live_members(c.redis, await c.connect(), config)
    known = sorted({m.retention_seconds for m in members.values() if m.retention_seconds is not None})
    if not known:
        raise CommandError(
            "no retention_seconds known: give --config (the workers' file), or run this while a worker of the "
            "key prefix is up (it records its retention)"
        )
    if len(known) > 1:
        return known[0], f"the shortest of the live workers' ({', '.join(map(str, known))})"
    return known[0], f"from the live workers' configuration ({len(members)} worker(s))"


async def _status(c: Any, group: str, config: Config, named: str | None) -> int:
    from sluice.worker.redis.lag import group_lag

    retention, source = await _retention(c, config, named)
    lags = await group_lag(c.redis, await c.connect(), group)
    now = int(time.time() * 1000)
    worst = 0
    for s in lags:
        age = s.age_ms(now)
        worst = max(worst, age)
        undelivered = "?" if s.undelivered is None else str(s.undelivered)
        group_note = "" if s.group_exists else "  (no archiver group yet: every entry is unarchived)"
        print(
            f"{s.stream}  pending {s.pending}  undelivered {undelivered}  "
            f"oldest unarchived {age / 1000:.1f}s{group_note}"
        )
    fraction = worst / (retention * 1000)
    print(f"archive lag {worst / 1000:.1f}s of retention {retention}s ({fraction:.1%}; retention_seconds {source})")
    return 1 if fraction >= 0.5 else 0


async def _verify(c: Any, dest: Destination, tables: RouteTables) -> int:
    counts = {"ok": 0, "not archived": 0, "differs": 0, "damaged": 0, "expired in Redis": 0}
    for shard in (await c.connect()).shards:
        for entry_id, fields in await c.redis.xrange(shard.terminal, "-", "+"):
            t = Terminal.from_entry(shard.terminal, entry_id.decode(), fields)
            live = await fetch_request(c, t)
            try:
                archived = await read_archived(dest, t.request_id, tables=tables)
            except ArchiveCorrupt as exc:
                key = "not archived" if exc.kind == "missing" else "damaged"
                counts[key] += 1
                print(f"{key:<13} {t.request_id}  {exc}")
                continue
            except DestinationError as exc:
                from sluice.cli.requests import CommandError

                raise CommandError(str(exc)) from None
            if live is None:
                counts["expired in Redis"] += 1
                continue
            diff = same_request(archived, live)
            counts["differs" if diff else "ok"] += 1
            if diff:
                print(f"differs       {t.request_id}  {diff}")
    print("verified: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if counts["differs"] or counts["damaged"] else 0

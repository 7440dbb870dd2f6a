"""``sluice dlq``: list the dead-letter stream, put a dead-lettered job back on the jobs stream, delete
entries, or purge the stream.

Rule: ``requeue`` refuses an entry without a job payload, a payload that is still not a valid job
(unless ``--force``) and a request some worker is running. A request that already ended (an unknown
route ends ``failed`` at once) is reset to ``queued`` *before* its job is re-added, so a worker picks it
up as a new attempt of the same request: its earlier attempts stay in its logs, and the terminal
stream gets a new entry when it ends again. The dead-letter entry is removed last. ``delete`` removes
named entries (all must exist, else nothing is removed) and ``purge`` the whole stream, only with ``--yes``;
neither touches a request's status or logs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import cast

import msgspec

from sluice.cli.requests import CommandError, config_from_args, redis_args, run_with_client
from sluice.client import SluiceClient
from sluice.schemas.errors import WorkerError
from sluice.schemas.jobs import JOB_FIELD, Job, decode_job, encode_job
from sluice.schemas.keys import Position, ShardKeys
from sluice.schemas.replies import StreamEntry, range_entries

__all__ = ["DeadLetter", "configure_parser", "delete", "list_dead_letters", "purge", "requeue", "run_from_args"]

_ENC = msgspec.json.Encoder()
# Status fields of a finished request that no longer hold once it is queued again.
_RESET_FIELDS = ("finished_at", "result_hash", "stop_reason", "error", "usage", "cancel")


class DeadLetter(msgspec.Struct, kw_only=True):
    id: str  # the dead-letter entry id
    request_id: str | None
    reason: str
    entry_id: str  # the jobs-stream entry it came from
    at: int | None
    has_job: bool


def _dead_letter(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    def get(k: bytes) -> str | None:
        return fields[k].decode("utf-8", "replace") if k in fields else None

    at = get(b"at")
    return DeadLetter(
        id=entry_id.decode(),
        request_id=get(b"request_id"),
        reason=get(b"reason") or "",
        entry_id=get(b"entry_id") or "",
        at=int(at) if at and at.isdigit() else None,
        has_job=JOB_FIELD.encode() in fields,
    )


async def list_dead_letters(c: SluiceClient, count: int | None = None) -> list[DeadLetter]:
    """Every shard's dead letters (one shard on the single-instance layout), oldest first."""
    out: list[DeadLetter] = []
    for shard in (await c.connect()).shards:
        entries = range_entries(await c.redis.xrange(shard.dead_letters, "-", "+", count=count))
        out += [_dead_letter(i, f) for i, f in entries]
    out.sort(key=lambda d: Position.from_entry_id(d.id))
    return out[:count] if count else out


async def _find(c: SluiceClient, dlq_id: str) -> tuple[ShardKeys, list[StreamEntry]]:
    """The shard holding dead-letter entry ``dlq_id`` and the entry. Raises ``CommandError``."""
    found = []
    for shard in (await c.connect()).shards:
        entries = range_entries(await c.redis.xrange(shard.dead_letters, dlq_id, dlq_id))
        if entries:
            found.append((shard, entries))
    if not found:
        raise CommandError(f"no dead-letter entry {dlq_id} (see `sluice dlq list`)")
    if len(found) > 1:  # ids are per stream: two shards may hold the same one
        raise CommandError(f"dead-letter entry {dlq_id} is in {len(found)} shards; delete the others first")
    return found[0]


async def requeue(c: SluiceClient, dlq_id: str, *, force: bool = False, max_job_bytes: int | None = None) -> str:
    """Put dead-letter entry ``dlq_id``'s job back on the jobs stream; returns a one-line report.
    Raises ``CommandError`` when it cannot."""
    shard, entries = await _find(c, dlq_id)
    fields = entries[0][1]
    dl = _dead_letter(entries[0][0], fields)
    payload = fields.get(JOB_FIELD.encode())
    if payload is None:
        raise CommandError(f"dead-letter entry {dlq_id} has no job payload (reason: {dl.reason}): nothing to requeue")
    job: Job | None = None
    try:
        job = decode_job(payload, **({"max_bytes": max_job_bytes} if max_job_bytes else {}))
    except WorkerError as exc:
        if not force:
            raise CommandError(
                f"dead-letter entry {dlq_id}: the job is still invalid ({exc.message}); fix it and "
                "`sluice enqueue` it, or requeue it as is with --force"
            ) from None
    rid = (job.request_id if job else None) or dl.request_id
    if job is not None and job.request_id is None and rid:
        # The worker named the request after the entry; the requeued job keeps that name.
        job = msgspec.structs.replace(job, request_id=rid)
        payload = encode_job(job)
    status_key = c.keys.request(rid).status if rid else None
    state = _text(await c.redis.hget(status_key, "state")) if status_key else ""
    if status_key and state == "running":  # a state is only read with a status key
        worker = _text(await c.redis.hget(status_key, "worker"), "?")
        raise CommandError(f"request {rid} is running (worker {worker}): not requeued")
    if job is not None and not state:
        new_id = await _enqueue_fresh(c, job)
    else:
        if status_key and state:
            # Reset first: a worker that took the job before this would find the request finished.
            async with c.redis.pipeline(transaction=True) as p:
                p.hdel(status_key, *_RESET_FIELDS)
                p.hset(status_key, mapping={"state": "queued", "queued_at": _now_ms(), "requeued_from": dlq_id})
                await p.execute()
        jobs = c.keys.shard_for(rid).jobs if rid else shard.jobs
        new_id = _text(await c.redis.xadd(jobs, {JOB_FIELD: payload}))
    await c.redis.xdel(shard.dead_letters, dlq_id)
    again = f", was {state}" if state else ""
    return f"requeued dead-letter {dlq_id} as job entry {new_id}" + (f" (request {rid}{again})" if rid else "")


async def delete(c: SluiceClient, dlq_ids: list[str]) -> str:
    """Remove dead-letter entries (from whichever shard holds each); refuses (removing none) when one does
    not exist. Raises ``CommandError``."""
    shards = (await c.connect()).shards
    where: dict[str, list[str]] = {}
    missing = []
    for i in dlq_ids:
        held = [s.dead_letters for s in shards if await c.redis.xrange(s.dead_letters, i, i)]
        if not held:
            missing.append(i)
        for stream in held:
            where.setdefault(stream, []).append(i)
    if missing:
        raise CommandError(f"no dead-letter entry {', '.join(missing)} (see `sluice dlq list`): nothing deleted")
    removed = 0
    for stream, ids in where.items():
        removed += int(await c.redis.xdel(stream, *ids))
    return f"deleted {removed} dead-letter entr{'y' if removed == 1 else 'ies'}"


async def purge(c: SluiceClient, *, yes: bool) -> str:
    """Delete the whole dead-letter stream (every shard's). Raises ``CommandError`` without ``yes``."""
    streams = [s.dead_letters for s in (await c.connect()).shards]
    count = sum([int(await c.redis.xlen(s)) for s in streams])
    if not yes:
        raise CommandError(f"this deletes all {count} dead-letter entries; run again with --yes")
    for stream in streams:  # one key per command: shards live in different slots
        await c.redis.delete(stream)
    return f"purged {count} dead-letter entr{'y' if count == 1 else 'ies'}"


async def _enqueue_fresh(c: SluiceClient, job: Job) -> str:
    await c.enqueue(job)
    rid = job.request_id
    return _text(await c.redis.hget(c.keys.request(rid).status, "job_entry"), "?") if rid else "?"


def _text(reply: bytes | str | None, default: str = "") -> str:
    """A string reply (``HGET``, ``XADD``'s id) as text, ``default`` when missing or empty. Bytes: the
    client does not decode responses."""
    return (cast(bytes | None, reply) or b"").decode() or default


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def configure_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dlq_command", required=True, metavar="{list,requeue,delete,purge}")
    ls = sub.add_parser(
        "list",
        help="list dead-lettered jobs: id, request_id, reason",
        description="List the dead-letter stream (oldest first): the entry id to requeue, the request id "
        "when one could be read, why the job could not run.",
        epilog="examples:\n  sluice dlq list\n  sluice dlq list --json | jq .reason",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ls.add_argument("--count", type=int, default=None, help="at most this many entries")
    ls.add_argument("--json", action="store_true", help="one JSON object per entry")
    redis_args(ls)
    rq = sub.add_parser(
        "requeue",
        help="put a dead-lettered job back on the jobs stream",
        description="Put the job of dead-letter entry ID back on the jobs stream and remove the entry. "
        "Refused when the entry has no job payload, when the job is still invalid (unless --force), or "
        "when its request is running. A request that already ended runs again as a new attempt.",
        epilog="examples:\n  sluice dlq requeue 1732900000000-0\n  sluice dlq requeue 1732900000000-0 --force",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rq.add_argument("id", help="the dead-letter entry id (from `sluice dlq list`)")
    rq.add_argument("--force", action="store_true", help="requeue even a job that does not decode")
    redis_args(rq)
    de = sub.add_parser(
        "delete",
        help="delete dead-letter entries",
        description="Delete the named dead-letter entries. All must exist, else none is deleted. The requests "
        "they name keep their status and logs.",
        epilog="examples:\n  sluice dlq delete 1732900000000-0\n  sluice dlq delete 1732900000000-0 1732900000001-0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    de.add_argument("ids", nargs="+", metavar="ID", help="dead-letter entry ids (from `sluice dlq list`)")
    redis_args(de)
    pu = sub.add_parser(
        "purge",
        help="delete every dead-letter entry",
        description="Delete the whole dead-letter stream (asks for --yes). Requests keep their status and logs.",
        epilog="examples:\n  sluice dlq purge --yes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pu.add_argument("--yes", action="store_true", help="really delete them all")
    redis_args(pu)


def run_from_args(args: argparse.Namespace) -> int:
    if args.dlq_command == "list":

        async def go_list(c: SluiceClient) -> int:
            if args.count is not None and args.count < 1:
                raise CommandError("--count must be at least 1")
            items = await list_dead_letters(c, args.count)
            if args.json:
                for item in items:
                    sys.stdout.buffer.write(_ENC.encode(item) + b"\n")
                sys.stdout.flush()
                return 0
            if not items:
                print("no dead-lettered jobs")
                return 0
            rows = [("ID", "REQUEST_ID", "AT", "JOB", "REASON")]
            rows += [(d.id, d.request_id or "-", _when(d.at), "yes" if d.has_job else "no", d.reason) for d in items]
            widths = [max(len(r[i]) for r in rows) for i in range(4)]
            for r in rows:
                print("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
            return 0

        return run_with_client(args, go_list)

    if args.dlq_command in ("delete", "purge"):

        async def go_remove(c: SluiceClient) -> int:
            print(await (delete(c, args.ids) if args.dlq_command == "delete" else purge(c, yes=args.yes)))
            return 0

        return run_with_client(args, go_remove)

    max_job_bytes = config_from_args(args).max_job_bytes

    async def go_requeue(c: SluiceClient) -> int:
        print(await requeue(c, args.id, force=args.force, max_job_bytes=max_job_bytes))
        return 0

    return run_with_client(args, go_requeue)

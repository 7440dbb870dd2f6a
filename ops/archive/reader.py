"""Reading the archive back: one request by id (``sluice audit --archive``), the index rows of a range of
days (``--since``, analysts), and the comparison with what Redis still holds (``sluice archive --verify``).

Rule: a request is read through its pointer; the object's bytes must hash to the pointer's SHA-256 and
decode whole (``sluice.archive.record``), and its index row must be what the archived status and log make
of it (``sluice.archive.proof``: tokens, cost, status, prices_version, every other field), else
``ArchiveCorrupt`` says missing, truncated or altered, so a damaged archive is never reported as a
normalizer mismatch and an edited billing row never reads as OK.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sluice.archive.proof import RouteTables, index_name, row_finding
from sluice.archive.record import (
    ArchiveCorrupt,
    ArchivedRequest,
    IndexRow,
    decode_index,
    decode_pointer,
    decode_record,
    pointer_name,
    sha256_hex,
)
from sluice.archive.store import Destination

__all__ = ["days_between", "index_rows", "read_archived", "same_request"]


async def read_archived(dest: Destination, request_id: str, *, tables: RouteTables | None = None) -> ArchivedRequest:
    """The archived request, its index row proven. ``tables``: the route price tables the caller holds
    (the configuration's), against which a row's cost is recomputed when its prices_version names one.
    Raises ``ArchiveCorrupt`` and ``DestinationError``."""
    ptr_bytes = await dest.get(pointer_name(request_id))
    if ptr_bytes is None:
        raise ArchiveCorrupt("missing", f"no archive pointer {pointer_name(request_id)} for request {request_id}")
    ptr = decode_pointer(ptr_bytes)
    data = await dest.get(ptr.object)
    if data is None:
        raise ArchiveCorrupt("missing", f"the pointer names {ptr.object}, which does not exist")
    if sha256_hex(data) != ptr.sha256:
        # What the bytes themselves say decides truncated or altered (a cut gzip stream, no end line);
        # bytes that decode whole but hash otherwise were altered.
        size = f"{len(data)} bytes, the pointer says {ptr.bytes}"
        try:
            decode_record(data)
        except ArchiveCorrupt as exc:
            raise ArchiveCorrupt(exc.kind, f"{ptr.object} ({size}): {exc.detail}") from None
        raise ArchiveCorrupt("altered", f"{ptr.object} ({size}) does not hash to the pointer's sha256")
    req = decode_record(data)
    if req.request_id != request_id or req.attempt != ptr.attempt:
        raise ArchiveCorrupt("altered", f"{ptr.object} holds {req.request_id} attempt {req.attempt}")
    name = index_name(ptr.object)
    row_bytes = await dest.get(name)
    try:
        row = None if row_bytes is None else decode_index(row_bytes)
    except ArchiveCorrupt as exc:
        raise ArchiveCorrupt("altered", f"request {request_id}: index row {name}: {exc.detail}") from None
    if (finding := row_finding(row, name, req, ptr, tables or {})) is not None:
        raise ArchiveCorrupt("altered", finding)
    return req


def days_between(start_ms: int, end_ms: int) -> list[str]:
    day = datetime.fromtimestamp(start_ms / 1000, UTC).date()
    last = datetime.fromtimestamp(end_ms / 1000, UTC).date()
    out = []
    while day <= last:
        out.append(day.isoformat())
        day += timedelta(days=1)
    return out


async def index_rows(dest: Destination, start_ms: int, end_ms: int) -> tuple[list[IndexRow], list[str]]:
    """The index rows of requests finished in ``[start_ms, end_ms]``, by finish time, and the names of
    rows that did not decode."""
    rows: list[IndexRow] = []
    bad: list[str] = []
    for day in days_between(start_ms, end_ms):
        for name in await dest.list(f"index/date={day}/"):
            data = await dest.get(name)
            if data is None:
                continue
            try:
                row = decode_index(data)
            except ArchiveCorrupt:
                bad.append(name)
                continue
            if start_ms <= row.finished_at <= end_ms:
                rows.append(row)
    rows.sort(key=lambda r: (r.finished_at, r.request_id))
    return rows, bad


def same_request(archived: ArchivedRequest, live: ArchivedRequest) -> str | None:
    """None when the archive holds exactly what Redis holds, else what differs."""
    if archived.attempt != live.attempt:
        return f"attempt {archived.attempt} archived, Redis is at attempt {live.attempt}"
    if archived.raw != live.raw:
        return f"raw log differs ({len(archived.raw)} archived, {len(live.raw)} in Redis)"
    if archived.events != live.events:
        return f"events differ ({len(archived.events)} archived, {len(live.events)} in Redis)"
    diff = sorted(
        k.decode() for k in set(archived.status) | set(live.status) if archived.status.get(k) != live.status.get(k)
    )
    return f"status fields differ: {', '.join(diff)}" if diff else None

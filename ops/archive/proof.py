"""An index row proven: what the analysts' billing query reads, recomputed from the archived request.

Rule: a row (``index/date=<day>/<request_id>.a<attempt>.json``) holds only what its archived object makes
of it. Every field is recomputed from the object the pointer names (``record.index_row`` over the
archived status, the pointer's object, SHA-256 and size), and the billing fields are recomputed from the
archived log itself: the final attempt's stored events, assembled (``normalizer.assemble``), give the
token counts, ``usage_reported`` and the status, which the archived status must state too. The cost is
bound to the usage: none without usage, a non-negative decimal with a currency and a ``prices_version``
when present, and, when the auditor's configuration holds the route's own price table under the same
``prices_version``, equal to the cost those prices make of the log's usage (``normalizer.pricing``). The
first field that differs is the finding, one line naming the request, the row and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal, InvalidOperation

import msgspec

from sluice.archive.record import ArchivedRequest, IndexRow, Names, Pointer, index_row, pointer_name
from sluice.normalizer.assemble import assemble
from sluice.normalizer.pricing import Prices, cost_of, format_cost
from sluice.schemas.events import StreamStart, Usage, decode_event
from sluice.schemas.keys import Position

__all__ = ["BILLING_FIELDS", "RouteTables", "final_usage", "index_name", "row_finding"]

# The fields the README's billing query sums and groups by; a finding about one of them comes first.
BILLING_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "cost",
    "currency",
    "status",
    "prices_version",
    "usage_reported",
    "budgets",
)
_TOKENS = BILLING_FIELDS[:5]
RouteTables = Mapping[str, tuple[Prices, str]]  # route -> (its own price table, that table's prices_version)


def index_name(object_name: str) -> str:
    """The index row beside an object: ``log/date=D/X.jsonl.gz`` -> ``index/date=D/X.json``."""
    return "index/" + object_name.removeprefix("log/").removesuffix(".jsonl.gz") + ".json"


class _Log(msgspec.Struct, frozen=True, kw_only=True):
    status: str
    usage: Usage | None
    start: StreamStart | None


def _final_attempt(req: ArchivedRequest) -> _Log | str:
    """What the final attempt's stored events say, or why they say nothing."""
    if not req.events:
        return "the archived log holds no events"
    try:
        attempts = [Position.from_entry_id(i).attempt for i, _ in req.events]
        last = max(attempts)
        events = [decode_event(f[b"event"]) for a, (_, f) in zip(attempts, req.events, strict=True) if a == last]
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, ValueError) as exc:
        return f"the archived log's events do not decode ({exc})"
    result = assemble(events)
    start = events[0] if isinstance(events[0], StreamStart) else None
    return _Log(status=result.status, usage=result.usage, start=start)


def final_usage(req: ArchivedRequest) -> tuple[Usage | None, str] | None:
    """The usage the final attempt's archived events report and that attempt's dialect; None when its events
    say nothing (no events, or events that do not decode)."""
    log = _final_attempt(req)
    if isinstance(log, str) or log.start is None:
        return None
    return log.usage, log.start.dialect


def _show(value: object) -> str:
    return "(none)" if value is None or value == "" else repr(value) if isinstance(value, str) else str(value)


def _recomputed(req: ArchivedRequest, ptr: Pointer) -> IndexRow:
    names = Names(ptr.object, index_name(ptr.object), pointer_name(req.request_id))
    return index_row(req, names, ptr.sha256, ptr.bytes)


def _cost_finding(row: IndexRow, log: _Log, req: ArchivedRequest, tables: RouteTables) -> str | None:
    if log.usage is None:
        return None if row.cost == "" else f"cost {row.cost!r} without any usage in the archived log"
    if row.cost == "":
        return None  # no price applied to this route and model
    try:
        cost = Decimal(row.cost)
    except InvalidOperation:
        return f"cost {row.cost!r} is not a decimal number"
    if not cost.is_finite() or cost < 0 or not row.currency or not row.prices_version:
        return f"cost {row.cost!r} {row.currency or '(no currency)'} under prices {_show(row.prices_version)}"
    route = req.status_text.get("attempt_route") or row.route
    table = tables.get(route)
    if table is None or table[1] != row.prices_version or log.start is None:
        return None  # prices this auditor does not hold: bound to the archived status only
    prices, _ = table
    expected = cost_of(log.usage, prices, log.start.dialect)
    if expected is None or format_cost(expected) != row.cost or prices.currency != row.currency:
        want = "(none)" if expected is None else f"{format_cost(expected)!r} {prices.currency}"
        return f"cost {row.cost!r} {row.currency}, prices {row.prices_version} make {want} of the archived log's usage"
    return None


def row_finding(row: IndexRow | None, name: str, req: ArchivedRequest, ptr: Pointer, tables: RouteTables) -> str | None:
    """None when the row ``name`` is what the archived request makes of it; else one line naming the
    request, the row and the first field that differs (billing fields first). ``tables``: the route price
    tables the auditor holds (may be empty)."""
    where = f"request {req.request_id}: index row {name}"
    if row is None:
        return f"{where} is missing (the archiver writes it before the pointer)"
    log = _final_attempt(req)
    if isinstance(log, str):
        return f"{where} cannot be proven: {log}"
    expected = _recomputed(req, ptr)
    from_log: dict[str, object] = {
        "status": log.status,
        "usage_reported": log.usage is not None,
        **{f: getattr(log.usage, f) if log.usage is not None else None for f in _TOKENS},
    }
    have, want = msgspec.structs.asdict(row), msgspec.structs.asdict(expected)
    order = [*BILLING_FIELDS, *(f for f in want if f not in BILLING_FIELDS)]
    for field in order:
        if field in from_log:
            logged = _show(from_log[field])
            if want[field] != from_log[field]:  # the object itself was rewritten, consistently
                said = _show(want[field])
                return f"request {req.request_id}: the archived status's {field} is {said}, its log says {logged}"
            if have[field] != from_log[field]:
                return f"{where}: {field} is {_show(have[field])}, the archived log says {logged}"
        elif have[field] != want[field]:
            source = "the pointer" if field in ("object", "sha256", "bytes") else "the archived status"
            return f"{where}: {field} is {_show(have[field])}, {source} says {_show(want[field])}"
    if (finding := _cost_finding(row, log, req, tables)) is not None:
        return f"{where}: {finding}"
    return None

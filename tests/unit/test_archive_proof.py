"""An index row proven against its archived request (sluice.archive.proof), pure: the row the archiver
writes is proven; each billing field edited is named (the tokens, usage_reported and status against the
log, the rest against the status or the pointer); a status whose usage is not its log's is named; a cost
is bound to the usage, and recomputed from a route price table under the row's prices_version."""

from __future__ import annotations

import msgspec
import pytest

from sluice.archive.proof import BILLING_FIELDS, index_name, row_finding
from sluice.archive.record import ArchivedRequest, IndexRow, Names, Pointer, index_row
from sluice.normalizer.pricing import Prices, cost_of, format_cost
from sluice.schemas.events import StreamDone, StreamStart, Usage

RID = "r-1"
USAGE = Usage(input_tokens=1200, output_tokens=340, cache_read_tokens=100)
PRICES = Prices(input="3", output="15", cache_read="0.3", currency="EUR")
VERSION = "2026-12"
COST = format_cost(cost_of(USAGE, PRICES, "anthropic"))
OBJECT = f"log/date=2026-12-07/{RID}.a1.jsonl.gz"


def _event(ev: object) -> dict[bytes, bytes]:
    return {b"event": msgspec.json.encode(ev)}


def _request(status: dict[bytes, bytes] | None = None, usage: Usage | None = USAGE) -> ArchivedRequest:
    start = StreamStart(
        stream_id=f"{RID}:1",
        request_id=RID,
        seq=0,
        ts=1,
        provider="anthropic",
        dialect="anthropic",
        model="m",
        attempt=1,
    )
    done = StreamDone(
        stream_id=f"{RID}:1",
        request_id=RID,
        seq=1,
        ts=2,
        stop_reason="stop",
        provider_stop_reason=None,
        usage=usage,
    )
    fields = {
        b"state": b"completed",
        b"route": b"claude",
        b"attempt": b"1",
        b"finished_at": b"1796601600000",
        b"usage": msgspec.json.encode(usage) if usage else b"",
        b"usage_reported": b"1" if usage else b"0",
        **({b"cost": COST.encode(), b"currency": b"EUR", b"prices_version": VERSION.encode()} if usage else {}),
        **(status or {}),
    }
    return ArchivedRequest(RID, 1, {}, fields, [], [(b"1-0", _event(start)), (b"1-1", _event(done))])


PTR = Pointer(request_id=RID, attempt=1, object=OBJECT, sha256="ab" * 32, bytes=999)
NAME = index_name(OBJECT)


def _row(req: ArchivedRequest, **edits: object) -> IndexRow:
    row = index_row(req, Names(OBJECT, NAME, f"id/{RID}.json"), PTR.sha256, PTR.bytes)
    return msgspec.structs.replace(row, **edits)


def test_index_name_is_the_objects_twin() -> None:
    assert index_name(OBJECT) == f"index/date=2026-12-07/{RID}.a1.json"


@pytest.mark.parametrize("usage", [USAGE, None], ids=["usage", "no usage"])
def test_the_row_the_archiver_writes_is_proven(usage: Usage | None) -> None:
    req = _request(usage=usage)
    tables = {"claude": (PRICES, VERSION)}
    assert row_finding(_row(req), NAME, req, PTR, tables) is None
    assert row_finding(_row(req), NAME, req, PTR, {}) is None


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("input_tokens", 1, "input_tokens is 1, the archived log says 1200"),
        ("output_tokens", 10_000, "output_tokens is 10000, the archived log says 340"),
        ("cache_read_tokens", None, "cache_read_tokens is (none), the archived log says 100"),
        ("reasoning_tokens", 5, "reasoning_tokens is 5, the archived log says (none)"),
        ("status", "failed", "status is 'failed', the archived log says 'completed'"),
        ("usage_reported", False, "usage_reported is False, the archived log says True"),
        ("cost", "0.1", f"cost is '0.1', the archived status says '{COST}'"),
        ("currency", "USD", "currency is 'USD', the archived status says 'EUR'"),
        ("prices_version", "2027-01", f"prices_version is '2027-01', the archived status says '{VERSION}'"),
        ("route", "other", "route is 'other', the archived status says 'claude'"),
        ("sha256", "cd" * 32, f"sha256 is '{'cd' * 32}', the pointer says '{'ab' * 32}'"),
    ],
)
def test_each_edited_field_is_named(field: str, value: object, says: str) -> None:
    req = _request()
    finding = row_finding(_row(req, **{field: value}), NAME, req, PTR, {})
    assert finding == f"request {RID}: index row {NAME}: {says}"


def test_billing_fields_come_first() -> None:
    req = _request()
    finding = row_finding(_row(req, route="other", cost="0.1"), NAME, req, PTR, {})
    assert finding is not None and ": cost is '0.1'" in finding
    assert BILLING_FIELDS.index("cost") < BILLING_FIELDS.index("prices_version")


def test_a_status_whose_usage_is_not_its_logs_is_named() -> None:
    req = _request({b"usage": msgspec.json.encode(Usage(input_tokens=1200, output_tokens=1, cache_read_tokens=100))})
    finding = row_finding(_row(req), NAME, req, PTR, {})
    assert finding == f"request {RID}: the archived status's output_tokens is 1, its log says 340"


def test_a_missing_row_and_an_unreadable_log() -> None:
    req = _request()
    assert row_finding(None, NAME, req, PTR, {}) == (
        f"request {RID}: index row {NAME} is missing (the archiver writes it before the pointer)"
    )
    for events in ([(b"1-0", {b"event": b"{}"})], [(b"x-0", req.events[0][1])], [(b"1-0", {})]):
        bad = ArchivedRequest(RID, 1, {}, req.status, [], events)
        finding = row_finding(_row(req), NAME, bad, PTR, {})
        assert finding is not None and finding.startswith(f"request {RID}: index row {NAME} cannot be proven: ")


def test_a_cost_is_bound_to_the_usage_and_to_the_prices() -> None:
    # Without usage no cost; a cost must be a non-negative decimal with a currency and a version.
    bare = _request(usage=None)
    costed = _request({b"cost": b"0.5", b"currency": b"EUR", b"prices_version": b"v"}, usage=None)
    assert row_finding(_row(costed), NAME, costed, PTR, {}) == (
        f"request {RID}: index row {NAME}: cost '0.5' without any usage in the archived log"
    )
    assert row_finding(_row(bare), NAME, bare, PTR, {}) is None
    for cost, currency in ((b"-1", b"EUR"), (b"NaN", b"EUR"), (b"0.5", b"")):
        req = _request({b"cost": cost, b"currency": currency})
        finding = row_finding(_row(req), NAME, req, PTR, {})
        assert finding is not None and finding.startswith(f"request {RID}: index row {NAME}: cost "), cost
    req = _request({b"cost": b"ten"})
    assert row_finding(_row(req), NAME, req, PTR, {}) == (
        f"request {RID}: index row {NAME}: cost 'ten' is not a decimal number"
    )
    # Rewritten consistently (status and row): only the prices find it, and only under the same version.
    req = _request({b"cost": b"0.000001"})
    assert row_finding(_row(req), NAME, req, PTR, {}) is None
    assert row_finding(_row(req), NAME, req, PTR, {"claude": (PRICES, "other")}) is None
    assert row_finding(_row(req), NAME, req, PTR, {"claude": (PRICES, VERSION)}) == (
        f"request {RID}: index row {NAME}: cost '0.000001' EUR, prices {VERSION} make '{COST}' EUR of the archived "
        "log's usage"
    )
    # A fallback attempt is priced by the route it ran on.
    req = _request({b"cost": b"0.000001", b"attempt_route": b"backup"})
    assert row_finding(_row(req), NAME, req, PTR, {"claude": (PRICES, VERSION)}) is None

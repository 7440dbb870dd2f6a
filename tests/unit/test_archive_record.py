"""The archive's object format: byte-exact round trip (any bytes, field order kept), deterministic bytes,
and no damage that decodes as a valid object: every truncation is ``truncated``, every flipped byte is
caught."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.archive.record import ArchiveCorrupt, ArchivedRequest, decode_record, encode_record, names_for

_fields = st.dictionaries(st.binary(min_size=1, max_size=8), st.binary(max_size=40), max_size=5)
_entries = st.lists(st.tuples(st.from_regex(r"\A[1-9]-[0-9]{1,3}\Z").map(str.encode), _fields), max_size=6)


def _req(raw: list, events: list, status: dict | None = None) -> ArchivedRequest:
    return ArchivedRequest(
        "r-1", 2, {"request_id": "r-1", "status": "completed"}, status or {b"state": b"completed"}, raw, events
    )


@given(_entries, _entries, _fields)
def test_round_trip_is_byte_exact_and_deterministic(raw: list, events: list, status: dict) -> None:
    req = _req(raw, events, status)
    data = encode_record(req)
    assert encode_record(req) == data
    back = decode_record(data)
    assert back == req
    assert [list(f) for _, f in back.raw] == [list(f) for _, f in raw]  # field order kept


SAMPLE = _req(
    [(b"1-0", {b"kind": b"http", b"data": b'{"status":200}'}), (b"1-1", {b"kind": b"sse", b"data_bytes": b"\xff\xfe"})],
    [(b"1-1", {b"event": b'{"type":"stream.start"}'})],
)


def test_every_truncation_is_reported_truncated() -> None:
    data = encode_record(SAMPLE)
    for cut in range(len(data)):
        with pytest.raises(ArchiveCorrupt) as err:
            decode_record(data[:cut])
        assert err.value.kind in ("truncated", "altered"), cut
        if cut > 20:  # past the gzip header a cut stream ends early
            assert err.value.kind == "truncated", cut


def test_every_flipped_byte_is_caught() -> None:
    data = encode_record(SAMPLE)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x55
        try:
            back = decode_record(bytes(bad))
        except ArchiveCorrupt:
            continue
        assert back == SAMPLE, i  # a flip only in gzip header flags/OS byte may leave the content intact


def test_names_are_fixed_by_request_attempt_and_finish_day() -> None:
    n = names_for("r-1", 2, 1_764_633_600_000)  # 2025-12-02T00:00:00Z
    assert (n.object, n.index, n.pointer) == (
        "log/date=2025-12-02/r-1.a2.jsonl.gz",
        "index/date=2025-12-02/r-1.a2.json",
        "id/r-1.json",
    )


def test_the_index_row_carries_the_budgets_the_status_names() -> None:
    from sluice.archive.record import Names, index_row

    status = {
        b"state": b"completed",
        b"finished_at": b"1800000000000",
        b"budgets": b'["budgets.acme","budgets.acme.keys.p1"]',
        b"provider_cost": b"0.0000655",
    }
    row = index_row(_req([], [], status), Names("o", "i", "p"), "0" * 64, 10)
    assert row.budgets == ["budgets.acme", "budgets.acme.keys.p1"] and row.provider_cost == "0.0000655"
    assert index_row(_req([], [], {b"state": b"completed"}), Names("o", "i", "p"), "0" * 64, 10).budgets == []

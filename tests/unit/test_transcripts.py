"""Every recorded transcript normalizes to its golden events and result, whatever the chunking.

Goldens live beside each ``<case>.sse`` as ``<case>.jsonl`` (the exact contract events, ts=0,
request_id ``req_t``) and ``<case>.result.json``. They are reviewed by hand; the per-dialect test modules
additionally spell out each case's sequence in ``brief`` form.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.schemas.events import decode_event, encode_event
from sluice.schemas.result import Result
from tests.helpers import check_invariants, rechunk, run, transcript_bodies

CASES = transcript_bodies()


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.stem}"


def _expected(path: Path) -> tuple[list[bytes], Result]:
    lines = path.with_suffix(".jsonl").read_bytes().splitlines()
    events = [encode_event(decode_event(line)) for line in lines if line.strip()]
    result = msgspec.json.decode(path.with_suffix(".result.json").read_bytes(), type=Result)
    return events, result


def test_there_are_transcripts() -> None:
    assert {p.parent.name for p in CASES} >= {"anthropic", "bedrock-converse"}


@pytest.mark.parametrize("path", CASES, ids=_id)
def test_transcript_matches_golden(path: Path) -> None:
    raw = path.read_bytes()
    _, events, result = run(path.parent.name, raw)
    want_events, want_result = _expected(path)
    assert [encode_event(e) for e in events] == want_events
    assert result == want_result
    check_invariants(events)


@pytest.mark.parametrize("path", CASES, ids=_id)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rechunking_never_changes_output(path: Path, data: st.DataObject) -> None:
    raw = path.read_bytes()
    cuts = data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=min(len(raw), 64)))
    whole = run(path.parent.name, raw)
    split = run(path.parent.name, rechunk(raw, cuts))
    assert split[1] == whole[1]
    assert split[2] == whole[2]
    assert [(e.index, e.offset, e.data) for e in split[0]] == [(e.index, e.offset, e.data) for e in whole[0]]


@pytest.mark.parametrize("path", CASES, ids=_id)
def test_byte_at_a_time(path: Path) -> None:
    raw = path.read_bytes()
    one = run(path.parent.name, [raw[i : i + 1] for i in range(len(raw))])
    assert one[1:] == run(path.parent.name, raw)[1:]

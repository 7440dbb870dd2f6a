"""``sluice audit`` recomputes output-check verdicts (contract 1.3) from the raw log and the status
record's declarations, under each attempt's policy, and reports a disagreement as one."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sluice.cli.audit import check_request, format_request
from sluice.normalizer.assemble import assemble
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import Normalizer
from sluice.schemas.checks import CheckSpec, encode_checks
from sluice.schemas.events import BlockStop, Event, Verdict
from sluice.schemas.raw import RawEntry
from sluice.schemas.result import result_hash
from tests.checked_cases import CALL_CASES, CALLS, body_path, checked_info
from tests.unit.test_cli_audit import T0, _redis_shape

SPEC = CALL_CASES["one_of_parallel_invalid"]


def _record(spec: CheckSpec | None, policy: Any, dialect: str = "openai-chat") -> tuple[list[RawEntry], list[Event]]:
    base = StreamInfo("r:1", "r", "", dialect, 1, "m-requested")
    info = checked_info(base, spec, policy) if spec is not None else base
    norm = Normalizer(dialect, info)
    body = body_path(dialect, CALLS[dialect]).read_bytes()
    raw: list[RawEntry] = [RawEntry(1, 0, "http", "http.response", '{"status":200,"headers":{}}', "", 0, T0)]
    events: list[Event] = []
    for k, start in enumerate(range(0, len(body), 9)):
        batch = norm.feed(body[start : start + 9], T0 + k)
        raw += [RawEntry(1, s.index, "sse", s.event, s.data, s.id, s.offset, T0 + k) for s in batch.raw]
        events += batch.events
    events += norm.close(T0 + 99_999)
    return raw, events


def _status(events: list[Event], spec: CheckSpec | None, r: list[Any], ev: list[Any]) -> dict[str, str]:
    result = assemble(events)
    status = {
        "state": result.status,
        "attempt": "1",
        "model": "m-requested",
        "raw_count": str(len(r)),
        "event_count": str(len(ev)),
        "result_hash": result_hash(result),
        "normalizer_version": "v1",
    }
    if spec is not None:
        status |= {"checks": encode_checks(spec).decode(), "validator": "jsonschema-rs 0.0"}
        if result.invalid_calls is not None:
            status["invalid_calls"] = str(result.invalid_calls)
    return status


@pytest.mark.parametrize("policy", ["record", "fail"])
def test_checked_requests_replay_exactly(policy: str) -> None:
    raw, events = _record(SPEC, policy)
    r, ev = _redis_shape(raw, events)
    audit = check_request("r", _status(events, SPEC, r, ev), r, ev, current_version="v1")
    assert audit.ok, format_request(audit)
    text = "\n".join(format_request(audit))
    assert "  checks: 1 invalid calls (judged by jsonschema-rs 0.0)" in text
    checked = "2 tool calls" if policy == "record" else "1 tool call"  # "fail" ends at the invalid one
    assert f"    checks ({policy}, recomputed with jsonschema-rs " in text
    assert f"): {checked} checked, 1 invalid" in text


def test_a_verdict_that_disagrees_is_the_first_divergence() -> None:
    raw, events = _record(SPEC, "record")
    forged: list[Event] = []
    for e in events:
        if isinstance(e, BlockStop) and isinstance(e.verdict, Verdict) and not e.verdict.valid:
            e = msgspec.structs.replace(e, verdict=Verdict(valid=True))  # what a forged log would claim
        forged.append(e)
    r, ev = _redis_shape(raw, forged)
    status = _status(forged, SPEC, r, ev)
    audit = check_request("r", status, r, ev, current_version="v1")
    assert not audit.ok
    div = audit.attempts[0].divergence
    assert div is not None and isinstance(div.stored, BlockStop) and div.stored.verdict == Verdict(valid=True)
    text = "\n".join(format_request(audit))
    assert f"    first divergence at seq {div.seq} (the verdicts disagree):" in text
    assert "problem: the status record counts 0 invalid calls, the replay 1" in text


def test_the_status_record_must_keep_the_declarations() -> None:
    raw, events = _record(SPEC, "record")
    r, ev = _redis_shape(raw, events)
    status = _status(events, SPEC, r, ev)
    del status["checks"]
    audit = check_request("r", status, r, ev, current_version="v1")
    assert audit.attempts[0].problem == (
        "stream.start says the output was checked (record), the status record keeps no checks"
    )


def test_a_stream_without_declarations_gets_no_verdict_in_the_replay() -> None:
    raw, events = _record(None, "record")
    r, ev = _redis_shape(raw, events)
    audit = check_request("r", _status(events, None, r, ev), r, ev, current_version="v1")
    assert audit.ok and "checks" not in "\n".join(format_request(audit))
    assert all(getattr(e, "verdict", msgspec.UNSET) is msgspec.UNSET for e in audit.attempts[0].replayed)

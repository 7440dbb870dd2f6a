"""Every dialect's checked transcripts (``tests/checked_cases.py``): a valid call, calls with schema errors,
a call to an undeclared tool, parallel calls of which one is invalid, a call the named ``tool_choice``
forbids, a structured answer that matches and one that does not, each under both policies, to their exact
goldens (``<transcript>.checked.json``); the same bytes without declarations give the plain golden, without
a verdict (``test_transcripts.py``)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import Event, decode_event
from sluice.schemas.result import Result
from tests.checked_cases import CALLS, POLICIES, body_path, cases, checked_info
from tests.helpers import briefs, check_invariants, info, rechunk

CASES = [
    (dialect, transcript, case, spec, policy)
    for dialect in CALLS
    for transcript, case, spec in cases(dialect)
    for policy in POLICIES
]

IDS = [f"{d}/{t}/{c}/{p}" for d, t, c, _, p in CASES]


def _golden(dialect: str, transcript: str, key: str) -> tuple[list[Event], Result]:
    doc = msgspec.json.decode(body_path(dialect, transcript).with_suffix(".checked.json").read_bytes())
    entry = doc[key]
    events = [decode_event(msgspec.json.encode(e)) for e in entry["events"]]
    return events, msgspec.convert(entry["result"], Result)


def _run(dialect: str, chunks: list[bytes], spec: Any, policy: Any) -> tuple[list[Event], Result]:
    _, events, result = normalize_bytes(chunks, dialect, checked_info(info(dialect), spec, policy))
    return events, result


def test_every_dialect_and_case_has_a_golden() -> None:
    assert {c[0] for c in CASES} == {"anthropic", "openai-chat", "openai-responses", "gemini", "bedrock-converse"}
    for dialect in CALLS:
        for transcript in {t for t, _, _ in cases(dialect)}:
            doc = msgspec.json.decode(body_path(dialect, transcript).with_suffix(".checked.json").read_bytes())
            assert set(doc) == {f"{case}/{p}" for t, case, _ in cases(dialect) if t == transcript for p in POLICIES}


@pytest.mark.parametrize(("dialect", "transcript", "case", "spec", "policy"), CASES, ids=IDS)
def test_checked_transcript_matches_golden(dialect: str, transcript: str, case: str, spec: Any, policy: str) -> None:
    events, result = _run(dialect, [body_path(dialect, transcript).read_bytes()], spec, policy)
    want_events, want_result = _golden(dialect, transcript, f"{case}/{policy}")
    assert events == want_events
    assert result == want_result
    check_invariants(events)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_rechunking_never_changes_a_verdict(data: st.DataObject) -> None:
    dialect, transcript, _, spec, policy = data.draw(st.sampled_from(CASES))
    raw = body_path(dialect, transcript).read_bytes()
    cuts = data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=32))
    assert _run(dialect, rechunk(raw, cuts), spec, policy) == _run(dialect, [raw], spec, policy)


def _brief(case: str, policy: str, dialect: str = "anthropic") -> list[str]:
    transcript, _, spec = next(c for c in cases(dialect) if c[1] == case)
    events, _ = _run(dialect, [body_path(dialect, transcript).read_bytes()], spec, policy)
    return [b for b in briefs(events) if not b.startswith(("open", "delta"))]


# The sequences spelled out by hand for one dialect (anthropic: get_weather is block 0, get_time block 1).
WEATHER_STOP = 'stop 0 {"city":"Paris"}'
TIME_STOP = 'stop 1 {"tz":"Europe/Paris"}'
START = "start claude-sonnet-4-5 checks="
FAILED = "failed invalid_output None retryable=False"


def test_by_hand_a_valid_call_and_calls_with_schema_errors() -> None:
    for policy in POLICIES:
        assert _brief("valid", policy) == [
            START + policy,
            f"{WEATHER_STOP} verdict=valid",
            f"{TIME_STOP} verdict=valid",
            "done tool_use tool_use",
        ]
    assert _brief("schema_errors", "record") == [
        START + "record",
        f"{WEATHER_STOP} verdict=schema::required,/city:maxLength",
        f"{TIME_STOP} verdict=schema:/tz:type",
        "done tool_use tool_use",
    ]
    assert _brief("schema_errors", "fail") == [
        START + "fail",
        f"{WEATHER_STOP} verdict=schema::required,/city:maxLength",
        FAILED,
    ]


def test_by_hand_an_undeclared_tool_and_one_invalid_of_parallel_calls() -> None:
    assert _brief("undeclared_tool", "record") == [
        START + "record",
        f"{WEATHER_STOP} verdict=valid",
        f"{TIME_STOP} verdict=undeclared_tool",
        "done tool_use tool_use",
    ]
    assert _brief("undeclared_tool", "fail") == [
        START + "fail",
        f"{WEATHER_STOP} verdict=valid",
        f"{TIME_STOP} verdict=undeclared_tool",
        FAILED,
    ]
    assert _brief("one_of_parallel_invalid", "fail") == [
        START + "fail",
        f"{WEATHER_STOP} verdict=schema::required,/city:maxLength",
        FAILED,
    ]
    assert _brief("tool_choice_named", "record")[2] == f"{TIME_STOP} verdict=tool_choice"


def test_by_hand_structured_answers() -> None:
    for policy in POLICIES:
        assert _brief("answer_matches", policy) == [START + policy, "stop 0", "done stop end_turn answer=valid"]
    assert _brief("answer_mismatch", "record") == [
        START + "record",
        "stop 0",
        "done stop end_turn answer=schema::required,/temp_c:maximum",
    ]
    assert _brief("answer_mismatch", "fail") == [
        START + "fail",
        "stop 0",
        FAILED + " answer=schema::required,/temp_c:maximum",
    ]


def test_the_failures_say_where_and_never_retry() -> None:
    _, _, spec = next(c for c in cases("openai-chat") if c[1] == "undeclared_tool")
    _, result = _run("openai-chat", [body_path("openai-chat", CALLS["openai-chat"]).read_bytes()], spec, "fail")
    assert result.status == "failed" and result.error is not None
    assert (result.error.category, result.error.retryable, result.error.block_index) == ("invalid_output", False, 1)
    assert result.error.message == "tool call get_time (block 1): 'get_time' is not among the job's tools"
    assert result.invalid_calls == 1

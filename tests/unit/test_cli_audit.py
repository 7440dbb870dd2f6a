"""The audit's pure core: re-framing recorded SSE events, replaying one attempt, judging a whole request.
Recordings are made the way the worker makes them (a Normalizer fed chunk by chunk, each chunk with its
own receive time) from every transcript in the repository."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from sluice.cli.audit import (
    RawEntry,
    Reframer,
    audit_attempt,
    check_request,
    format_request,
    parse_duration,
    sse_body,
)
from sluice.normalizer.assemble import assemble
from sluice.normalizer.http_errors import classify_http_error
from sluice.normalizer.limits import Limits
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.normalizer.sse import SSEDecoder
from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import BlockDelta, ErrorInfo, Event, StreamError, encode_event
from sluice.schemas.result import result_hash
from tests.helpers import TRANSCRIPTS, briefs, transcript_bodies

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "ops" / "harness" / "fake" / "examples"
BODIES = sorted([*transcript_bodies(), *EXAMPLES.glob("*/*.sse"), *EXAMPLES.glob("*/*.eventstream")])
T0 = 1_700_000_000_000


def record(dialect: str, body: bytes, chunk: int = 7, *, close: bool = True) -> tuple[list[RawEntry], list[Event]]:
    """What the worker would store for this body: raw entries and events, chunk k received at T0 + k."""
    norm = Normalizer(dialect, StreamInfo("r:1", "r", "", dialect, 1, "m-requested"))
    raw: list[RawEntry] = [RawEntry(1, 0, "http", "http.response", '{"status":200,"headers":{}}', "", 0, T0)]
    events: list[Event] = []
    for k, start in enumerate(range(0, len(body), chunk)):
        ts = T0 + k
        batch = norm.feed(body[start : start + chunk], ts)
        raw += [
            RawEntry(1, s.index, "frame" if s.frame else "sse", s.event, s.data, s.id, s.offset, ts, frame=s.frame)
            for s in batch.raw
        ]
        events += batch.events
    if close:
        events += norm.close(T0 + 99_999)
    return raw, events


# -- re-framing ----------------------------------------------------------------------------------------------


def _decode(body: bytes) -> list[tuple[str, str, str, int, int, bool]]:
    d = SSEDecoder()
    evs = d.feed(body)
    d.close()
    return [(e.event, e.data, e.id, e.index, e.offset, e.invalid_utf8) for e in evs]


def test_reframer_round_trips_fields_ids_and_offsets() -> None:
    entries = [
        RawEntry(1, 1, "sse", "message", '{"a":1}', "", 0, 5),
        RawEntry(1, 2, "sse", "content_block_delta", " leading space\n\nafter an empty line", "7", 20),
        RawEntry(1, 3, "sse", " spaced event", "x\u2028y\u0085z", "7", 110),  # U+2028/NEL are content
        RawEntry(1, 4, "sse", "message", "", "", 111 + 40),  # an empty data line; the id is reset
        RawEntry(1, 5, "sse", "message", "big gap", "", 200_000),
        RawEntry(1, 6, "sse", "message", "gap of one", "", None),  # no recorded offset: no padding
    ]
    body = sse_body(entries)
    got = _decode(body)
    assert [g[:4] for g in got] == [(e.event, e.data, e.id, e.index) for e in entries]
    assert [g[4] for g in got[:5]] == [0, 20, 110, 151, 200_000]  # the recorded offsets, padded with comments
    assert all(len(line) <= 64 * 1024 for line in body.split(b"\n"))


@pytest.mark.parametrize("gap", [1, 2, 3, 65_536, 65_537, 65_538, 200_001])
def test_padding_of_any_size_dispatches_nothing(gap: int) -> None:
    body = sse_body([RawEntry(1, 1, "sse", "message", "x", "", gap)])
    assert _decode(body) == [("message", "x", "", 1, gap, False)]


def test_an_offset_behind_the_position_is_not_padded() -> None:
    entries = [RawEntry(1, 1, "sse", "message", "a" * 50, "", 0), RawEntry(1, 2, "sse", "message", "b", "", 10)]
    got = _decode(sse_body(entries))
    assert [(g[1], g[4]) for g in got] == [("a" * 50, 0), ("b", 57)]


def test_invalid_utf8_is_written_back_as_invalid_bytes() -> None:
    entry = RawEntry(1, 1, "sse", "message", "caf\ufffd", "", 0)
    assert _decode(sse_body([entry])) == [("message", "caf\ufffd", "", 1, 0, False)]
    assert _decode(sse_body([entry], invalid_utf8=[1])) == [("message", "caf\ufffd", "", 1, 0, True)]


def test_reframer_frames_one_event_at_a_time() -> None:
    framer = Reframer()
    first = framer.frame(RawEntry(1, 1, "sse", "ping", "{}", "", 3))
    assert first == b": \nevent:ping\ndata:{}\n\n"  # a comment pads to the recorded offset
    second = framer.frame(RawEntry(1, 2, "sse", "message", "a\n b", "id-1", None))
    assert second == b"id:id-1\ndata:a\ndata:  b\n\n"
    assert framer.position == len(first) + len(second)


# -- one attempt ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", BODIES, ids=lambda p: f"{p.parent.name}/{p.stem}")
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_every_recorded_transcript_replays_exactly(body: Path, chunk: int) -> None:
    dialect = body.parent.name
    raw, stored = record(dialect, body.read_bytes(), chunk)
    audit = audit_attempt("r", 1, raw, stored, model="m-requested")
    assert audit.ok, (audit.explanation, audit.divergence, audit.problem)
    assert audit.replayed == stored  # ts included: each event carries its raw event's receive time
    assert audit.ts_differences == 0
    assert audit.ending in ("provider", "eof", "recorded")


@pytest.mark.parametrize("mode", ["fail", "replace"])
def test_invalid_utf8_replays_in_both_modes(mode: str) -> None:
    body = b'event: message_start\ndata: {"type":"message_start","message":{"model":"m","usage":{}}}\n\n'
    body += b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    body += b'"content_block":{"type":"text","text":""}}\n\n'
    body += b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    body += b'"delta":{"type":"text_delta","text":"caf\xc3 ok"}}\n\n'
    body += b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    body += b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    limits = Limits(invalid_utf8=mode)  # type: ignore[arg-type]
    norm = Normalizer("anthropic", StreamInfo("r:1", "r", "", "anthropic", 1, None), limits)
    batch = norm.feed(body, T0)
    stored = batch.events + norm.close(T0 + 1)
    raw = [RawEntry(1, s.index, "sse", s.event, s.data, s.id, s.offset, T0) for s in batch.raw]
    assert "\ufffd" in raw[2].data
    expected = "failed protocol None retryable=False" if mode == "fail" else "warning invalid_utf8 1"
    assert expected in briefs(stored)
    audit = audit_attempt("r", 1, raw, stored, limits=limits)
    assert audit.ok and audit.replayed == stored


def test_a_changed_event_is_reported_at_its_seq_with_both_sides() -> None:
    raw, stored = record("anthropic", (TRANSCRIPTS / "anthropic" / "text_tool_use.sse").read_bytes())
    i = next(i for i, ev in enumerate(stored) if isinstance(ev, BlockDelta))
    original = stored[i]
    assert isinstance(original, BlockDelta)
    stored[i] = msgspec.structs.replace(original, delta=msgspec.structs.replace(original.delta, text="X"))
    audit = audit_attempt("r", 1, raw, stored, model="m-requested")
    assert not audit.ok and audit.divergence is not None
    assert (audit.divergence.seq, audit.divergence.position) == (original.seq, i)
    assert audit.divergence.stored == stored[i] and audit.divergence.replayed == original


def test_a_missing_event_and_an_extra_event() -> None:
    raw, stored = record("openai-chat", (EXAMPLES / "openai-chat" / "hello.sse").read_bytes())
    audit = audit_attempt("r", 1, raw, stored[:-2] + stored[-1:], model="m-requested")
    assert audit.divergence is not None
    assert (audit.divergence.seq, audit.divergence.stored, audit.divergence.replayed) == (
        stored[-2].seq,
        None,
        stored[-2],
    )
    audit = audit_attempt("r", 1, raw[:-1], stored, model="m-requested")  # the last raw event was lost
    assert audit.divergence is not None
    assert audit.divergence.stored == stored[audit.divergence.position]


def test_a_receive_time_difference_is_reported_not_judged() -> None:
    raw, stored = record("anthropic", (TRANSCRIPTS / "anthropic" / "max_tokens.sse").read_bytes())
    stored[1] = msgspec.structs.replace(stored[1], ts=stored[1].ts + 5)
    audit = audit_attempt("r", 1, raw, stored, model="m-requested")
    assert audit.ok and audit.ts_differences == 1


def _cut(dialect: str, name: str, n_events: int) -> tuple[list[RawEntry], Normalizer, list[Event]]:
    """The first n raw events of a transcript, fed as the worker would, without an ending."""
    body = (TRANSCRIPTS / dialect / f"{name}.sse").read_bytes()
    raw, _ = record(dialect, body, close=False)
    raw = raw[: n_events + 1]
    norm = Normalizer(dialect, StreamInfo("r:1", "r", "", dialect, 1, "m-requested"))
    events: list[Event] = []
    framer = Reframer()
    for e in raw[1:]:
        events += norm.feed(framer.frame(e), e.ts).events
    return raw, norm, events


def test_an_attempt_ended_by_a_timer_is_explained_by_its_recorded_reason() -> None:
    raw, norm, events = _cut("anthropic", "text_tool_use", 4)
    stored = events + norm.interrupt("timeout", "idle timeout (10s) fired", T0 + 500)
    audit = audit_attempt("r", 1, raw, stored, model="m-requested")
    assert audit.ok and audit.ending == "recorded" and audit.ts_differences == 0
    assert audit.explanation == (
        "ended outside the provider's events after 4 raw events: interrupted / timeout: idle timeout (10s) fired"
    )


def test_a_provider_category_cannot_explain_an_unended_stream() -> None:
    raw, norm, events = _cut("anthropic", "text_tool_use", 4)
    stored = events + norm.fail("overloaded", "Overloaded", T0 + 500, provider_code="overloaded_error")
    audit = audit_attempt("r", 1, raw, stored, model="m-requested")
    assert not audit.ok and audit.ending == "eof"
    assert "not one sluice records from outside the stream" in audit.explanation
    assert audit.divergence is not None and audit.divergence.seq == stored[-1].seq


def test_an_http_error_attempt() -> None:
    norm = Normalizer("anthropic", StreamInfo("r:2", "r", "", "anthropic", 2, "m"))
    stored = norm.fail("overloaded", "provider answered HTTP 529", T0, provider_code="529", retryable=True)
    raw = [RawEntry(2, 0, "http", "http.response", '{"status":529,"headers":{}}', "", 0, T0)]
    audit = audit_attempt("r", 2, raw, stored, model="m")
    assert audit.ok and audit.http_status == 529 and audit.raw_sse == 0
    assert briefs(audit.replayed) == ["start m", "failed overloaded 529 retryable=True"]
    assert audit.explanation.startswith("ended outside the provider's events HTTP 529: failed / overloaded")


def test_an_http_error_replays_from_its_stored_body_exactly() -> None:
    body = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'
    fail = classify_http_error(529, body)
    norm = Normalizer("anthropic", StreamInfo("r:1", "r", "", "anthropic", 1, "m"))
    stored = norm.fail(fail.category, fail.message, T0, provider_code=fail.provider_code, retryable=fail.retryable)
    raw = [RawEntry(1, 0, "http", "http.response", '{"status":529,"headers":{}}', "", 0, T0, body=body)]
    audit = audit_attempt("r", 1, raw, stored, model="m")
    assert audit.ok and audit.ending == "http", audit.explanation
    assert audit.explanation == f"HTTP 529, replayed from the stored body: failed / overloaded: {fail.message}"
    # a stored failure the body does not say is caught
    other = RawEntry(1, 0, "http", "http.response", '{"status":529,"headers":{}}', "", 0, T0, body=b"{}")
    assert not audit_attempt("r", 1, [other], stored, model="m").ok


def test_invalid_utf8_and_an_unfinished_tail_replay_from_their_exact_bytes() -> None:
    body = (
        b'data: {"type":"message_start","message":{"model":"m","usage":{"input_tokens":1}}}\n\n'
        b'event: ping\ndata: {"type":"ping","note":"\xff\xfe"}\n\n'
        b'event: content_block_start\ndata: {"ty'
    )
    info = StreamInfo("r:1", "r", "", "anthropic", 1, "m")
    limits = Limits(invalid_utf8="replace")
    norm = Normalizer("anthropic", info, limits)
    batch = norm.feed(body, T0)
    stored = batch.events + norm.close(T0)
    raw = [RawEntry(1, 0, "http", "http.response", '{"status":200,"headers":{}}', "", 0, T0)]
    for s in batch.raw:
        raw.append(RawEntry(1, s.index, "sse", s.event, s.data, s.id, s.offset, T0, data_bytes=s.data_bytes))
    assert raw[2].data_bytes == b'{"type":"ping","note":"\xff\xfe"}'
    tail = norm.decoder.dropped_tail
    assert tail == b'event: content_block_start\ndata: {"ty'
    raw.append(RawEntry(1, 3, "tail", offset=norm.decoder.dropped_at, ts=T0, data_bytes=tail))
    audit = audit_attempt("r", 1, raw, stored, model="m", limits=limits)
    assert audit.ok and audit.ending == "eof", (audit.explanation, audit.divergence)  # replayed from the bytes
    assert f"({len(tail)} bytes of an unfinished event dropped)" in stored[-1].error.message  # type: ignore[union-attr]
    # without the tail the ending can only be taken as recorded, not replayed
    assert audit_attempt("r", 1, raw[:-1], stored, model="m", limits=limits).ending == "recorded"


def test_an_attempt_that_never_reached_a_provider() -> None:
    machine = StreamMachine(StreamInfo("r:1", "r", "none", "none", 1))
    stored = machine.fail("invalid_request", "unknown route 'x'", ts=T0, retryable=False)
    audit = audit_attempt("r", 1, [], stored)
    assert audit.ok and audit.ending == "recorded"
    stray = [RawEntry(1, 1, "sse", "message", "{}", "", 0, T0)]
    audit = audit_attempt("r", 1, stray, stored)
    assert audit.problem == "1 raw provider events recorded for an attempt without a dialect"


def test_a_lost_worker_is_closed_after_its_last_seq() -> None:
    raw, _, events = _cut("anthropic", "text_tool_use", 3)
    lost = StreamError(
        stream_id="r:1",
        request_id="r",
        seq=len(events) + 1,
        ts=T0 + 7,
        status="interrupted",
        error=ErrorInfo(category="worker_lost", retryable=False, message="the worker running this attempt was lost"),
    )
    audit = audit_attempt("r", 1, raw, [*events, lost], model="m-requested")
    assert audit.ok and audit.ending == "recorded"


def test_a_stream_without_stream_start() -> None:
    raw, stored = record("anthropic", (TRANSCRIPTS / "anthropic" / "max_tokens.sse").read_bytes())
    audit = audit_attempt("r", 1, raw, stored[1:], model="m-requested")
    assert audit.problem == "the stored stream does not begin with stream.start"


# -- a whole request -------------------------------------------------------------------------------------------


def _redis_shape(raw: list[RawEntry], events: list[Event]) -> tuple[list, list]:
    r = [
        (
            f"{e.attempt}-{e.index}".encode(),
            {
                b"kind": e.kind.encode(),
                b"event": e.event.encode(),
                b"data": e.data.encode(),
                b"id": e.id.encode(),
                b"offset": str(e.offset).encode(),
                b"ts": str(e.ts).encode(),
            },
        )
        for e in raw
    ]
    ev = [(f"1-{e.seq}".encode(), {b"type": b"x", b"event": encode_event(e)}) for e in events]
    return r, ev


def test_check_request_hashes_counts_and_state() -> None:
    raw, stored = record("anthropic", (TRANSCRIPTS / "anthropic" / "thinking_then_text.sse").read_bytes())
    r, ev = _redis_shape(raw, stored)
    good = result_hash(assemble(stored))
    status = {
        "state": "completed",
        "attempt": "1",
        "model": "m-requested",
        "raw_count": str(len(r)),
        "event_count": str(len(ev)),
        "result_hash": good,
        "normalizer_version": "v1",
    }
    audit = check_request("r", status, r, ev, current_version="v1")
    assert audit.ok and audit.stored_hash == audit.replayed_hash == good
    text = "\n".join(format_request(audit))
    assert text.startswith("audit r: OK\n") and f"result hash: {good} (status record = stored events = replay)" in text

    bad = check_request("r", {**status, "result_hash": "sha256:0", "event_count": "1"}, r, ev, current_version="v2")
    assert not bad.ok
    assert bad.problems == [
        f"the status record counts 1 event entries but the stream holds {len(ev)}",
        "the status record's result_hash sha256:0 is not the stored events'",
        "the status record's result_hash sha256:0 is not the replay's",
    ]
    text = "\n".join(format_request(bad))
    assert "note: the stream was written by v1; a different normalizer may explain the mismatch" in text
    assert not check_request("r", {**status, "state": "running"}, r, ev).ok
    assert check_request("r", {}, r, ev).problems == ["no status record (unknown request, or its keys expired)"]


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("90s", 90_000),
        ("10m", 600_000),
        ("2h", 7_200_000),
        ("1h30m", 5_400_000),
        ("7d", 604_800_000),
        ("500ms", 500),
        ("1.5h", 5_400_000),
        ("1w", 604_800_000),
    ],
)
def test_parse_duration(text: str, ms: int) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize("text", ["", "10", "m", "10 m", "ten minutes", "0s", "-5m", "5m garbage"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(text)

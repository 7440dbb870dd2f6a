"""WHATWG text/event-stream framing (HTML §9.2.5-9.2.6), one case per rule, as exact bytes.

Rule: every expectation is written by hand from the spec, never from the decoder's own output; the
hypothesis properties then show that no re-chunking of the same bytes (down to 1-byte chunks) changes
a single frame, offset, counter or limit error.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.normalizer.sse import SSEDecoder, SSEEvent, SSELimitExceeded
from sluice.schemas.errors import LimitExceeded
from tests.helpers import rechunk

BOM = b"\xef\xbb\xbf"


def decode(chunks: Sequence[bytes] | bytes, **kw: int) -> tuple[list[SSEEvent], SSEDecoder, int]:
    """Feed the chunks, then close; returns the frames, the decoder and close()'s dropped bytes."""
    if isinstance(chunks, bytes):
        chunks = [chunks]
    d = SSEDecoder(**kw)
    out: list[SSEEvent] = []
    for c in chunks:
        out += d.feed(c)
    return out, d, d.close()


def data(chunks: Sequence[bytes] | bytes) -> list[str]:
    return [e.data for e in decode(chunks)[0]]


def bytewise(raw: bytes) -> list[bytes]:
    return [raw[i : i + 1] for i in range(len(raw))]


# -- line endings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n",  # CRLF
        b"data: a\ndata: b\n\ndata: c\n\n",  # LF
        b"data: a\rdata: b\r\rdata: c\r\r",  # CR only
        b"data: a\r\ndata: b\r\rdata: c\n\r\n",  # mixed
    ],
    ids=["crlf", "lf", "cr", "mixed"],
)
def test_line_endings(raw: bytes) -> None:
    assert data(raw) == ["a\nb", "c"]
    assert data(bytewise(raw)) == ["a\nb", "c"]


def test_cr_at_chunk_end_then_lf_is_one_line_end_not_a_blank_line() -> None:
    # "data: a\r" + "\ndata: b\n\n": the LF completes the CRLF, so there is no blank line after "a".
    frames, _, _ = decode([b"data: a\r", b"\ndata: b\n\n"])
    assert [(e.data, e.offset) for e in frames] == [("a\nb", 0)]


def test_cr_at_chunk_end_waits_across_empty_chunks() -> None:
    frames, _, _ = decode([b"data: a\r", b"", b"", b"\n", b"\n"])
    assert [e.data for e in frames] == ["a"]


def test_cr_at_chunk_end_then_cr_is_a_blank_line() -> None:
    frames, _, _ = decode([b"data: a\r", b"\r", b"data: b\r\r"])
    assert [e.data for e in frames] == ["a", "b"]


def test_lone_cr_inside_a_chunk_does_not_swallow_the_next_chunks_lf() -> None:
    frames, _, _ = decode([b"data: a\rdata: b", b"\n\n"])
    assert [e.data for e in frames] == ["a\nb"]


def test_cr_at_chunk_end_then_other_byte_is_a_lone_cr() -> None:
    frames, _, _ = decode([b"data: a\r", b"data: b\n\n"])
    assert [e.data for e in frames] == ["a\nb"]


@pytest.mark.parametrize(
    "inner",
    ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"],
    ids=["LS", "PS", "NEL", "VT", "FF", "FS", "GS", "RS"],
)
def test_unicode_and_control_breaks_are_content(inner: str) -> None:
    raw = f'data: {{"t": "x{inner}y"}}\n\n'.encode()
    assert data(raw) == [f'{{"t": "x{inner}y"}}']


# -- BOM ------------------------------------------------------------------------------------------


def test_one_leading_bom_is_stripped_and_a_second_is_content() -> None:
    # After the first BOM, "\ufeffdata" is an unknown field name: the second line is ignored.
    frames, _, _ = decode(BOM + BOM + b"data: a\n\ndata: b\n\n")
    assert [(e.data, e.offset) for e in frames] == [("b", 15)]
    assert data(BOM + b"data: a\n\n") == ["a"]


def test_bom_split_across_chunks() -> None:
    frames, _, _ = decode([b"\xef", b"\xbb", b"\xbfdata: a\n\n"])
    assert [(e.data, e.offset) for e in frames] == [("a", 3)]
    assert data([b"\xef\xbb", b"\xbf", BOM + b"data: a\n\n"]) == []  # the second BOM spoils the name


def test_bom_prefix_that_is_not_a_bom_is_kept() -> None:
    # \xef\xbb then 'd': not a BOM, so the bytes are the (invalid UTF-8) start of a field name.
    assert data([b"\xef\xbb", b"data: a\n\n"]) == []
    assert data([b"\xef", b"data: a\n\n"]) == []


def test_bom_inside_data_is_content() -> None:
    assert data(b"data: " + BOM + b"x\n\n") == ["\ufeffx"]


# -- fields -----------------------------------------------------------------------------------------


def test_comments_are_ignored_but_counted() -> None:
    frames, d, _ = decode(b": keep-alive\n:\ndata: a\n: inside\n\n: OPENROUTER PROCESSING\r\n")
    assert [e.data for e in frames] == ["a"]
    assert d.comments == 4
    assert d.statistics()["comments"] == 4


def test_only_one_space_after_the_colon_is_stripped() -> None:
    raw = b"data:x\n\ndata: x\n\ndata:  x\n\ndata:\tx\n\ndata: \n\n"
    assert data(raw) == ["x", "x", " x", "\tx", ""]


def test_field_name_ends_at_the_first_colon() -> None:
    frames, _, _ = decode(b"event: a:b\ndata: c: d\n\n")
    assert [(e.event, e.data) for e in frames] == [("a:b", "c: d")]


def test_line_without_colon_is_a_field_with_empty_value() -> None:
    assert data(b"data\n\n") == [""]
    assert data(b"data\ndata\n\n") == ["\n"]
    frames, _, _ = decode(b"event\ndata: x\n\n")
    assert frames[0].event == "message"


def test_data_lines_are_joined_with_lf() -> None:
    assert data(b"data: a\ndata:\ndata: b\n\n") == ["a\n\nb"]


def test_empty_data_buffer_dispatches_nothing_but_the_id_persists() -> None:
    frames, d, _ = decode(b"event: x\n\nid: 7\n\nretry: 10\n\ndata: a\n\n")
    assert [(e.event, e.data, e.id, e.retry, e.index) for e in frames] == [("message", "a", "7", 10, 1)]
    assert d.last_event_id == "7"


def test_event_type_resets_after_each_dispatch_and_defaults_to_message() -> None:
    frames, _, _ = decode(b"event: ping\ndata: 1\n\ndata: 2\n\nevent: x\n\ndata: 3\n\n")
    assert [(e.event, e.data) for e in frames] == [("ping", "1"), ("message", "2"), ("message", "3")]


def test_last_event_id_persists_across_events() -> None:
    frames, d, _ = decode(b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n")
    assert [(e.data, e.id) for e in frames] == [("a", "1"), ("b", "1"), ("c", "2")]
    assert d.last_event_id == "2"


def test_id_containing_nul_is_ignored() -> None:
    frames, _, _ = decode(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n")
    assert [(e.data, e.id) for e in frames] == [("a", "1"), ("b", "1")]


def test_bare_id_resets_the_buffer() -> None:
    frames, d, _ = decode(b"id: 1\ndata: a\n\nid\ndata: b\n\nid:\ndata: c\n\n")
    assert [e.id for e in frames] == ["1", "", ""]
    assert d.last_event_id == ""


def test_last_event_id_takes_effect_only_at_a_blank_line() -> None:
    # An id in an event cut off by EOF never reaches the event source's last event ID.
    _, d, _ = decode(b"id: 1\ndata: a\n\nid: 2\ndata: b\n")
    assert d.last_event_id == "1"


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (b"retry: 1500", 1500),
        (b"retry:1500", 1500),
        (b"retry: 0", 0),
        (b"retry:  1500", None),  # value " 1500": not all digits
        (b"retry: 1.5", None),
        (b"retry: -1", None),
        (b"retry: 15x", None),
        (b"retry: \xef\xbc\x91\xef\xbc\x92", None),  # fullwidth "１２"
        (b"retry: \xd9\xa1", None),  # Arabic-Indic digit one
        (b"retry:", None),
        (b"retry", None),
    ],
)
def test_retry_only_if_all_ascii_digits(line: bytes, want: int | None) -> None:
    frames, d, _ = decode(line + b"\ndata: x\n\n")
    assert frames[0].retry == want
    assert d.retry == want


def test_invalid_retry_keeps_the_previous_value() -> None:
    frames, _, _ = decode(b"retry: 10\ndata: a\n\nretry: x\ndata: b\n\n")
    assert [e.retry for e in frames] == [10, 10]


@pytest.mark.parametrize("line", [b"Data: x", b"DATA: x", b" data: x", b"data : x", b"datum: x", b"EVENT: y", b"Id: 9"])
def test_unknown_or_case_different_field_names_are_ignored(line: bytes) -> None:
    frames, _, _ = decode(line + b"\ndata: z\n\n")
    assert [(e.event, e.data, e.id) for e in frames] == [("message", "z", "")]


# -- end of input -----------------------------------------------------------------------------------


def test_trailing_event_without_blank_line_is_dropped_at_close() -> None:
    raw = b"data: a\n\nevent: e\ndata: b\n"
    frames, _, dropped = decode(raw)
    assert [e.data for e in frames] == ["a"]
    assert dropped == len(b"event: e\ndata: b\n")


def test_close_reports_an_unterminated_partial_line() -> None:
    assert decode(b"data: a\n\ndata: b")[2] == len(b"data: b")
    assert decode(b"data: a\r")[2] == len(b"data: a\r")


def test_close_reports_nothing_when_nothing_is_pending() -> None:
    assert decode(b"data: a\n\n")[2] == 0
    assert decode(b"data: a\n\n: keep-alive\n")[2] == 0
    assert decode(b"data: a\n\n: keep-al")[2] == 0
    assert decode(b"")[2] == 0


# -- positions --------------------------------------------------------------------------------------


def test_indices_and_byte_offsets() -> None:
    raw = b": hi\ndata: a\n\nid: 3\n\nevent: e\r\ndata: bb\r\n\r\ndata: c\r\r"
    frames, d, _ = decode(raw)
    # Offsets point at each event's first field line (comments before it are not part of it).
    assert [(e.index, e.offset, e.event, e.data, e.id) for e in frames] == [
        (1, 5, "message", "a", ""),
        (2, raw.index(b"event: e"), "e", "bb", "3"),
        (3, raw.index(b"data: c"), "message", "c", "3"),
    ]
    assert d.statistics()["events"] == 3
    assert d.statistics()["bytes_in"] == len(raw)


def test_offsets_count_the_bom_and_swallowed_lf() -> None:
    raw = BOM + b"data: a\r\n\r\ndata: b\n\n"
    for chunks in ([raw], bytewise(raw), [raw[:10], raw[10:]]):
        frames, _, _ = decode(chunks)
        assert [(e.data, e.offset) for e in frames] == [("a", 3), ("b", 3 + 11)]


# -- UTF-8 ------------------------------------------------------------------------------------------


def test_invalid_utf8_becomes_replacement_and_is_flagged() -> None:
    frames, d, _ = decode(b"data: a\xffb\n\ndata: ok\n\nevent: \xc3\ndata: c\n\n")
    assert [(e.event, e.data, e.invalid_utf8) for e in frames] == [
        ("message", "a\ufffdb", True),
        ("message", "ok", False),
        ("\ufffd", "c", True),
    ]
    assert d.statistics()["invalid_utf8_events"] == 2


def test_truncated_utf8_sequence_before_line_end() -> None:
    frames, _, _ = decode(b"data: \xe2\x82\ndata: x\n\n")
    assert [(e.data, e.invalid_utf8) for e in frames] == [("\ufffd\nx", True)]


@pytest.mark.parametrize("text", ["€", "я", "字", "😀"])
def test_utf8_character_split_across_chunks(text: str) -> None:
    raw = f"data: {text}\n\n".encode()
    frames, _, _ = decode(bytewise(raw))
    assert [(e.data, e.invalid_utf8) for e in frames] == [(text, False)]


# -- limits -----------------------------------------------------------------------------------------


def test_oversize_complete_line_keeps_events_before_it() -> None:
    d = SSEDecoder(max_line_bytes=16)
    with pytest.raises(SSELimitExceeded) as ei:
        d.feed(b"data: 1\n\ndata: 2\n\ndata: " + b"x" * 20 + b"\n\n")
    assert isinstance(ei.value, LimitExceeded)
    assert ei.value.what == "SSE line" and ei.value.limit == 16
    assert [e.data for e in ei.value.events] == ["1", "2"]


def test_line_exactly_at_the_cap_is_allowed() -> None:
    line = b"data: " + b"x" * 10
    frames, _, _ = decode([line[:5], line[5:] + b"\n\n"], max_line_bytes=len(line))
    assert [e.data for e in frames] == ["x" * 10]


def test_oversize_partial_line_raises_before_its_end_arrives() -> None:
    d = SSEDecoder(max_line_bytes=16)
    assert [e.data for e in d.feed(b"data: 1\n\ndata: 0123456789")] == ["1"]  # 16 bytes: still fine
    with pytest.raises(SSELimitExceeded) as ei:
        d.feed(b"a")
    assert ei.value.events == []
    assert d.statistics()["buffered_bytes"] == 0


def test_oversize_event() -> None:
    d = SSEDecoder(max_line_bytes=64, max_event_bytes=20)
    first = d.feed(b"data: ok\n\n")
    with pytest.raises(SSELimitExceeded) as ei:
        d.feed(b"data: 0123456789\ndata: 0123456789\n\n")
    assert [e.data for e in first] == ["ok"]
    assert ei.value.what == "SSE event" and ei.value.limit == 20
    assert ei.value.events == []


def test_memory_is_bounded_and_the_failure_is_sticky() -> None:
    cap, chunk = 100, b"y" * 7
    d = SSEDecoder(max_line_bytes=cap)
    d.feed(b"data: ")
    fed = 6
    with pytest.raises(SSELimitExceeded):
        while True:
            d.feed(chunk)
            fed += len(chunk)
            assert d.statistics()["buffered_bytes"] == fed <= cap
    assert fed + len(chunk) > cap
    assert d.statistics()["buffered_bytes"] == 0
    for later in (b"\n\n", b"data: a\n\n", b""):
        with pytest.raises(SSELimitExceeded):
            d.feed(later)
    assert d.statistics()["buffered_bytes"] == 0


def test_many_data_lines_without_blank_line_are_bounded_by_the_event_cap() -> None:
    d = SSEDecoder(max_line_bytes=64, max_event_bytes=1000)
    with pytest.raises(SSELimitExceeded) as ei:
        for _ in range(10_000):
            d.feed(b"data: 0123456789\n")
    assert ei.value.what == "SSE event"
    assert d.statistics()["buffered_bytes"] == 0


# -- properties -------------------------------------------------------------------------------------

_TEXT = st.text(
    alphabet=st.sampled_from(["a", "Z", " ", ":", "{", '"', "я", "字", "😀", "\u2028", "\x85", "\x0b", "\x0c"]),
    max_size=8,
)
_EOLS = st.sampled_from([b"\n", b"\r", b"\r\n"])


@st.composite
def _line(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["data", "event", "id", "retry", "comment", "bare", "unknown", "blank"]))
    if kind == "blank":
        return b""
    if kind == "comment":
        return b":" + draw(_TEXT).encode()
    if kind == "bare":
        return draw(st.sampled_from([b"data", b"id", b"event"]))
    if kind == "retry":
        value = draw(st.sampled_from([b"1500", b" 1500", b"1.5", b"\xef\xbc\x91", b"0"]))
        return b"retry:" + value
    name = {"unknown": b"Data"}.get(kind, kind.encode())
    value = draw(_TEXT).encode()
    if kind == "id" and draw(st.booleans()):
        value += b"\x00"
    if draw(st.integers(0, 9)) == 0:
        value += b"\xff"  # invalid UTF-8
    sep = draw(st.sampled_from([b":", b": ", b":  "]))
    return name + sep + value


@st.composite
def sse_streams(draw: st.DrawFn) -> bytes:
    out = bytearray(BOM if draw(st.booleans()) else b"")
    for line in draw(st.lists(_line(), max_size=25)):
        out += line + draw(_EOLS)
    out += draw(st.sampled_from([b"", b"\n", b"\r", b"data: tail"]))
    return bytes(out)


def _observe(chunks: Sequence[bytes], **kw: int) -> tuple[object, ...]:
    d = SSEDecoder(**kw)
    frames: list[SSEEvent] = []
    error: tuple[str, int] | None = None
    try:
        for c in chunks:
            frames += d.feed(c)
    except SSELimitExceeded as exc:
        frames += exc.events
        error = (exc.what, exc.limit)
    last_id, retry = d.last_event_id, d.retry
    dropped = d.close() if error is None else None
    return frames, error, d.comments, last_id, retry, dropped, d.invalid_utf8


@settings(max_examples=300, deadline=None)
@given(raw=sse_streams(), data=st.data())
def test_rechunking_never_changes_frames(raw: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw)))
    whole = _observe([raw])
    assert _observe(rechunk(raw, cuts)) == whole
    assert _observe(bytewise(raw)) == whole


@settings(max_examples=200, deadline=None)
@given(raw=sse_streams(), data=st.data())
def test_rechunking_never_changes_limit_errors(raw: bytes, data: st.DataObject) -> None:
    limits = {"max_line_bytes": data.draw(st.integers(4, 40)), "max_event_bytes": data.draw(st.integers(4, 60))}
    cuts = data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw)))
    whole = _observe([raw], **limits)
    assert _observe(rechunk(raw, cuts), **limits) == whole
    assert _observe(bytewise(raw), **limits) == whole


# -- the unframed JSON option (Gemini's error tail) ---------------------------------------------------

TAIL = (
    b'{\n  "error": {\n    "code": 503,\n    "message": "a } in {text} \\" too",\n    "status": "UNAVAILABLE"\n  }\n}\n'
)


def unframed(chunks: Sequence[bytes] | bytes, **kw: int) -> tuple[list[SSEEvent], int]:
    if isinstance(chunks, bytes):
        chunks = [chunks]
    d = SSEDecoder(unframed_json=True, **kw)
    out: list[SSEEvent] = []
    for c in chunks:
        out += d.feed(c)
    tail, dropped = d.close_events()
    return out + tail, dropped


def test_by_default_unframed_json_is_ignored_as_the_spec_says() -> None:
    events, _, dropped = decode(b"data: a\r\n\r\n" + TAIL)
    assert [e.data for e in events] == ["a"] and dropped == len(TAIL)  # unknown fields of an unended event


def test_an_unframed_object_is_one_event_flagged_unframed() -> None:
    body = b"data: a\r\n\r\n" + TAIL + b"data: b\n\n"
    events, dropped = unframed(body)
    assert [(e.index, e.data, e.unframed, e.offset) for e in events] == [
        (1, "a", False, 0),
        (2, TAIL[:-1].decode(), True, 11),
        (3, "b", False, 11 + len(TAIL)),
    ]
    assert dropped == 0


@pytest.mark.parametrize("end", [b"", b"\n", b"\r\n", b"   "])
def test_the_object_is_dispatched_at_its_closing_brace_or_at_the_end_of_input(end: bytes) -> None:
    body = b"data: a\r\n\r\n" + TAIL[:-1] + end
    events, dropped = unframed(body)
    assert [e.data for e in events] == ["a", TAIL[:-1].decode() + end.rstrip(b"\r\n").decode()]
    assert dropped == 0


def test_an_unbalanced_object_is_still_dispatched_at_the_end_of_input() -> None:
    events, _ = unframed(b'{"error": {"code": 5')
    assert [(e.data, e.unframed) for e in events] == [('{"error": {"code": 5', True)]


def test_close_alone_reports_an_unbalanced_object_as_dropped() -> None:
    d = SSEDecoder(unframed_json=True)
    assert d.feed(b'{"error":\n') == []
    assert d.close() == len(b'{"error":\n')


def test_a_brace_line_inside_an_event_is_a_field_of_that_event() -> None:
    events, _ = unframed(b'data: a\n{"x": 1}\n\n')
    assert [(e.data, e.unframed) for e in events] == [("a", False)]


def test_an_unframed_object_counts_against_the_event_cap() -> None:
    with pytest.raises(SSELimitExceeded):
        unframed(b"{\n" + b'"x": 1,\n' * 10 + b"}\n", max_event_bytes=40)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_rechunking_never_changes_unframed_events(data: st.DataObject) -> None:
    body = b"data: a\r\n\r\n" + TAIL + b"data: b\n\n" + TAIL[:-1]
    cuts = data.draw(st.lists(st.integers(1, len(body) - 1), max_size=20))
    assert unframed(rechunk(body, cuts)) == unframed(body)

"""AWS event-stream framing (``application/vnd.amazon.eventstream``), as exact bytes.

Rule: the hand-written frames are built here with ``struct`` and ``crc32`` from the spec's layout, never with
the decoder's own encoder; the properties then show that no re-chunking changes a message, that every bit
flip in a frame is a protocol failure at once (never a stall), that a stream cut at any byte ends as an
incomplete message (``interrupted`` through the Normalizer), and that an oversize frame is refused from its
prelude alone.
"""

from __future__ import annotations

import struct
import uuid
from binascii import crc32
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.normalizer.eventstream import (
    EventStreamDecoder,
    EventStreamLimitExceeded,
    EventStreamProtocolError,
    Timestamp,
    Uuid,
    encode_frame,
)
from sluice.normalizer.limits import Limits
from sluice.normalizer.sse import HeaderValue, SSEEvent
from tests.helpers import rechunk, run


def frame(headers: bytes, payload: bytes, *, total: int | None = None, headers_len: int | None = None) -> bytes:
    """A message laid out by hand: prelude (total, headers length, CRC), headers, payload, message CRC."""
    t = 16 + len(headers) + len(payload) if total is None else total
    h = len(headers) if headers_len is None else headers_len
    prelude = struct.pack(">II", t, h)
    body = prelude + struct.pack(">I", crc32(prelude)) + headers + payload
    return body + struct.pack(">I", crc32(body))


def string_header(name: str, value: str) -> bytes:
    return bytes([len(name)]) + name.encode() + b"\x07" + struct.pack(">H", len(value)) + value.encode()


def event_headers(event_type: str) -> bytes:
    return (
        string_header(":event-type", event_type)
        + string_header(":content-type", "application/json")
        + string_header(":message-type", "event")
    )


HELLO = frame(event_headers("contentBlockDelta"), b'{"contentBlockIndex":0,"delta":{"text":"Hi"}}')


def decode(chunks: Sequence[bytes] | bytes, **kw: int) -> tuple[list[SSEEvent], EventStreamDecoder, int]:
    if isinstance(chunks, bytes):
        chunks = [chunks]
    d = EventStreamDecoder(**kw)
    out: list[SSEEvent] = []
    for c in chunks:
        out += d.feed(c)
    return out, d, d.close()


# -- one message, by hand ---------------------------------------------------------------------------


def test_one_message_decodes_to_its_headers_payload_and_exact_bytes() -> None:
    [ev], d, dropped = decode(HELLO)
    assert (ev.event, ev.id, ev.data) == ("contentBlockDelta", "event", '{"contentBlockIndex":0,"delta":{"text":"Hi"}}')
    assert ev.headers == {
        ":event-type": "contentBlockDelta",
        ":content-type": "application/json",
        ":message-type": "event",
    }
    assert (ev.index, ev.offset, ev.frame, dropped) == (1, 0, HELLO, 0)
    assert d.statistics() == {"bytes_in": len(HELLO), "events": 1, "buffered_bytes": 0}


def test_header_blocks_of_one_length_are_told_apart_by_their_bytes() -> None:
    # "messageStop" and "messageStart" differ in length; these two event types do not: each message is
    # named by its own header block, however often the previous one repeated.
    a, b = event_headers("contentBlockStop"), event_headers("contentBlockStxp")
    assert len(a) == len(b) and a != b
    frames = [frame(h, b"{}") for h in (a, a, b, a, b, b, b"")]
    for chunks in ([b"".join(frames)], frames, [bytes([x]) for x in b"".join(frames)]):
        got, _, _ = decode(chunks)
        assert [e.event for e in got] == [*["contentBlockStop"] * 2, "contentBlockStxp", "contentBlockStop"] + [
            "contentBlockStxp"
        ] * 2 + [""]
        assert [e.frame for e in got] == frames


def test_every_header_value_type_of_the_spec() -> None:
    u = uuid.UUID("0123456789abcdef0123456789abcdef")
    headers = b"".join(
        [
            b"\x01t\x00",  # 0: true
            b"\x01f\x01",  # 1: false
            b"\x01b\x02" + struct.pack(">b", -7),
            b"\x01s\x03" + struct.pack(">h", -300),
            b"\x01i\x04" + struct.pack(">i", -70000),
            b"\x01l\x05" + struct.pack(">q", -(2**40)),
            b"\x01a\x06" + struct.pack(">H", 3) + b"\x00\xff\x10",
            b"\x01u\x07" + struct.pack(">H", 4) + "é!".encode() + b"!",
            b"\x02ts\x08" + struct.pack(">q", 1_700_000_000_123),
            b"\x02id\x09" + u.bytes,
        ]
    )
    [ev], _, _ = decode(frame(headers, b""))
    assert ev.headers == {
        "t": True,
        "f": False,
        "b": -7,
        "s": -300,
        "i": -70000,
        "l": -(2**40),
        "a": b"\x00\xff\x10",
        "u": "é!!",
        "ts": 1_700_000_000_123,
        "id": u.bytes,
    }
    assert isinstance(ev.headers["id"], Uuid) and str(ev.headers["id"]) == str(u)
    assert ev.headers is not None and isinstance(ev.headers["ts"], Timestamp)
    assert (ev.event, ev.id, ev.data) == ("", "", "")


def test_exception_and_error_messages_are_named_by_their_type() -> None:
    exc = frame(
        string_header(":exception-type", "throttlingException") + string_header(":message-type", "exception"),
        b'{"message":"slow down"}',
    )
    err = frame(
        string_header(":message-type", "error")
        + string_header(":error-code", "InternalFailure")
        + string_header(":error-message", "boom"),
        b"",
    )
    evs, _, _ = decode(exc + err)
    assert [(e.event, e.id, e.data, e.index, e.offset) for e in evs] == [
        ("throttlingException", "exception", '{"message":"slow down"}', 1, 0),
        ("InternalFailure", "error", "", 2, len(exc)),
    ]


def test_the_encoder_lays_out_the_same_bytes_as_the_spec() -> None:
    assert (
        encode_frame(
            {":event-type": "contentBlockDelta", ":content-type": "application/json", ":message-type": "event"},
            b'{"contentBlockIndex":0,"delta":{"text":"Hi"}}',
        )
        == HELLO
    )


# -- faults: typed, at once -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (frame(b"", b"", total=15), "impossible lengths (total 15, headers 0)"),
        (frame(b"", b"", total=0), "impossible lengths (total 0, headers 0)"),
        (frame(b"", b"xx", headers_len=3), "impossible lengths (total 18, headers 3)"),
        (frame(b"\x00\x07", b""), "a header name is empty"),
        (frame(b"\x01x\x0a", b""), "header 'x' has unknown value type 10"),
        (frame(b"\x01x\x00\x01x\x01", b""), "header 'x' appears twice"),
        (frame(b"\x01x\x07\x00\x09abc", b""), "a 9-byte value runs past the headers"),
        (frame(b"\x01x\x04\x00\x00", b""), "a 4-byte value runs past the headers"),
        (frame(b"\x01x\x09" + b"\x00" * 15, b""), "a uuid value runs past the headers"),
        (frame(b"\x01x\x07\x00\x01\xff", b""), "a string value is not UTF-8"),
        (frame(b"\x01\xff\x00", b""), "a header name is not UTF-8"),
    ],
)
def test_malformed_frames_are_protocol_errors(raw: bytes, message: str) -> None:
    d = EventStreamDecoder()
    with pytest.raises(EventStreamProtocolError, match="event-stream message at byte 0: ") as info:
        d.feed(HELLO[:0] + raw)
    assert message in info.value.message
    assert info.value.broken is not None and info.value.broken.frame == raw
    with pytest.raises(EventStreamProtocolError):  # and again on every later call, carrying nothing
        d.feed(b"")


def test_a_fault_keeps_the_messages_before_it() -> None:
    bad = bytearray(HELLO)
    bad[-1] ^= 1
    d = EventStreamDecoder()
    with pytest.raises(EventStreamProtocolError, match=f"at byte {len(HELLO)}: message CRC mismatch") as info:
        d.feed(HELLO + bytes(bad))
    assert [e.index for e in info.value.events] == [1]
    assert info.value.broken is not None
    assert (info.value.broken.index, info.value.broken.offset, info.value.broken.frame) == (2, len(HELLO), bad)
    assert d.close() == 0


def test_every_bit_flip_in_a_frame_is_detected_at_once() -> None:
    for bit in range(len(HELLO) * 8):
        flipped = bytearray(HELLO)
        flipped[bit // 8] ^= 1 << (bit % 8)
        d = EventStreamDecoder()
        with pytest.raises(EventStreamProtocolError, match="CRC mismatch"):
            d.feed(bytes(flipped))


def test_every_bit_flip_fails_the_stream_protocol() -> None:
    start = frame(event_headers("messageStart"), b'{"role":"assistant"}')
    for bit in range(len(HELLO) * 8):
        flipped = bytearray(HELLO)
        flipped[bit // 8] ^= 1 << (bit % 8)
        _, events, result = run("bedrock-converse", start + bytes(flipped))
        assert result.status == "failed" and result.error is not None, bit
        assert result.error.category == "protocol", bit
        assert events[-1].raw == [2]


def test_an_oversize_frame_is_refused_from_its_prelude() -> None:
    big = frame(event_headers("contentBlockDelta"), b"x" * 200)
    d = EventStreamDecoder(max_frame_bytes=100)
    with pytest.raises(EventStreamLimitExceeded, match="event-stream message at byte 0 exceeds the limit of 100"):
        d.feed(big[:12])
    _, _, result = run("bedrock-converse", big, limits=Limits(max_event_bytes=100))
    assert result.status == "failed" and result.error is not None and result.error.category == "limit_exceeded"


# -- truncation and re-chunking ---------------------------------------------------------------------

STREAM = b"".join(
    [
        frame(event_headers("messageStart"), b'{"role":"assistant"}'),
        HELLO,
        frame(event_headers("contentBlockStop"), b'{"contentBlockIndex":0}'),
        frame(event_headers("messageStop"), b'{"stopReason":"end_turn"}'),
        frame(event_headers("metadata"), b'{"usage":{"inputTokens":1,"outputTokens":2}}'),
    ]
)


def test_truncation_at_every_byte_ends_incomplete() -> None:
    ends = [len(frame(event_headers("messageStart"), b'{"role":"assistant"}'))]
    whole, _, _ = decode(STREAM)
    offsets = [e.offset for e in whole] + [len(STREAM)]
    for cut in range(len(STREAM)):
        evs, d, dropped = decode(STREAM[:cut])
        complete = [e for e in whole if e.offset + len(e.frame or b"") <= cut]
        assert [e.frame for e in evs] == [e.frame for e in complete], cut
        start = offsets[len(complete)]
        assert dropped == cut - start, cut
        assert (d.dropped_tail, d.dropped_at) == ((STREAM[start:cut], start) if dropped else (b"", 0)), cut
        _, _, result = run("bedrock-converse", STREAM[:cut])
        assert result.status == "interrupted", cut
    assert ends[0] == offsets[1]
    assert run("bedrock-converse", STREAM)[2].status == "completed"


header_values: st.SearchStrategy[HeaderValue] = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.builds(Timestamp, st.integers(0, 2**62)),
    st.binary(max_size=20),
    st.text(max_size=20),
    st.builds(lambda u: Uuid(u.bytes), st.uuids()),
)
messages = st.lists(
    st.tuples(
        st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda s: len(s.encode()) < 256), header_values),
        st.binary(max_size=60),
    ),
    max_size=6,
)


def _observe(chunks: list[bytes]) -> tuple[list[tuple[object, ...]], int]:
    evs, _, dropped = decode(chunks)
    return [(e.event, e.id, e.data, e.headers, e.index, e.offset, e.frame) for e in evs], dropped


@settings(max_examples=300, deadline=None)
@given(msgs=messages, data=st.data())
def test_rechunking_never_changes_messages(
    msgs: list[tuple[dict[str, HeaderValue], bytes]], data: st.DataObject
) -> None:
    raw = b"".join(encode_frame(h, p) for h, p in msgs)
    raw += data.draw(st.sampled_from([b"", b"\x00\x00"]))  # sometimes an unfinished tail
    cuts = data.draw(st.lists(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw)))
    whole = _observe([raw])
    assert _observe(rechunk(raw, cuts)) == whole
    assert _observe([raw[i : i + 1] for i in range(len(raw))]) == whole
    assert [e[3] for e in whole[0]] == [h for h, _ in msgs]  # every header value comes back, typed


@settings(max_examples=100, deadline=None)
@given(msgs=messages.filter(bool), data=st.data())
def test_any_bit_flip_in_any_stream_is_a_protocol_error(
    msgs: list[tuple[dict[str, HeaderValue], bytes]], data: st.DataObject
) -> None:
    raw = bytearray(b"".join(encode_frame(h, p) for h, p in msgs))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(EventStreamProtocolError):
        decode(bytes(raw))

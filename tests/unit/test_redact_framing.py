"""An echoed credential, in every framing: the stream redacted the way the worker redacts it
(``Normalizer.redact_with``) ends exactly as the same stream does when the provider sent the marker in the
secret's place (same events, categories, messages), whatever the chunking; the stored raw entries hold no
secret, flag the redacted one, and ``audit_attempt`` replays them to the same events. One case per SSE
dialect (an error the provider echoes the key in), and AWS event-stream (Bedrock): an exception message, a
text delta followed by a message whose fault cites its byte offset, a broken message and an unfinished one."""

from __future__ import annotations

import struct
from binascii import crc32

import msgspec
import pytest

from sluice.cli.audit import RawEntry, audit_attempt
from sluice.normalizer.eventstream import EventStreamDecoder, encode_frame
from sluice.normalizer.redact import Redactor
from sluice.normalizer.sse import SSEEvent
from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import Event, StreamError
from sluice.schemas.raw import REDACTION_MARKER
from sluice.worker.append.log import PendingBatch
from tests.eventstream_transcripts import START, ev, exc, text
from tests.helpers import TRANSCRIPTS, briefs, info

SECRET = "sk-proj-Echoed/Key-0123456789abcdefghij"
M = REDACTION_MARKER
T0 = 1_700_000_000_000


def _recorded(dialect: str, body: bytes, chunk: int) -> tuple[list[RawEntry], list[Event], str]:
    """What the worker stores for ``body`` read ``chunk`` bytes at a time with ``SECRET`` configured: the raw
    entries (through ``PendingBatch``, so the redacted flag is the one stored), the events, and every byte
    and text stored (to look for the secret)."""
    norm = Normalizer(dialect, info(dialect))
    redacting = norm.redact_with(Redactor([SECRET]))
    batches: list[PendingBatch] = []
    events: list[Event] = []

    def store(raw: list[SSEEvent], evs: list[Event], ts: int) -> None:
        batches.append(PendingBatch.normalized(raw, evs, ts))
        events.extend(evs)

    for k, start in enumerate(range(0, len(body), chunk)):
        if not norm.terminal:
            store(*norm.feed(redacting.feed(body[start : start + chunk]), T0 + k), T0 + k)
    if not norm.terminal:
        store(*norm.feed(redacting.flush(), T0 + 9_998), T0 + 9_998)
        last = norm.close_batch(T0 + 9_999)
        store(last.raw, last.events, T0 + 9_999)
        if norm.decoder.dropped_tail:
            batches[-1].add_tail(
                norm.decoder.dispatched + 1, norm.decoder.dropped_tail, norm.decoder.dropped_at, T0 + 9_999
            )
    entries: list[RawEntry] = []
    stored = ""
    for b in batches:
        stored += repr((b.raw, b.blobs))
        for row in b.raw:
            index, kind, event, data, sse_id, offset, ts, *pairs = row
            extra = dict(zip(pairs[::2], pairs[1::2], strict=True))
            blob = {k: b.blobs[v - 1] for k, v in extra.items() if isinstance(v, int)}
            entries.append(
                RawEntry(
                    1, index, kind, event, data, sse_id, offset, ts,  # type: ignore[arg-type]
                    redacted=extra.get("redacted") == "1", unframed=extra.get("unframed") == "1",
                    data_bytes=blob.get("data_bytes"), frame=blob.get("frame"),
                )
            )  # fmt: skip
    stored += repr(events)
    return entries, events, stored


def _plain(dialect: str, body: bytes) -> list[Event]:
    """The stream as the provider would have sent it with the marker itself, without a redactor."""
    norm = Normalizer(dialect, info(dialect))
    events: list[Event] = []
    for k, start in enumerate(range(0, len(body), 7)):
        events += norm.feed(body[start : start + 7], T0 + k).events
    return events + norm.close(T0 + 9_999)


def _same(a: list[Event], b: list[Event]) -> None:
    """Equal event for event, receive times aside (the two runs read different chunks)."""

    def bare(ev: Event) -> object:
        return msgspec.structs.replace(ev, ts=0)

    assert [bare(e) for e in a] == [bare(e) for e in b]


def _check(dialect: str, echoed: bytes, plain: bytes, expected: list[str], *, redacted: int = 1) -> None:
    for chunk in (1, 5, 64, len(echoed)):
        entries, events, stored = _recorded(dialect, echoed, chunk)
        assert briefs(events) == expected
        _same(events, _plain(dialect, plain))
        assert SECRET not in stored and SECRET.replace("/", "\\/") not in stored
        assert sum(e.redacted for e in entries) == redacted, [e for e in entries if e.redacted]
        audit = audit_attempt("req_t", 1, entries, events)
        assert audit.ok and audit.divergence is None, audit
        _same(audit.replayed, events)


SSE_CASES = {
    "openai-chat": (
        "error_after_text.sse",
        "The server had an error while processing your request. Sorry about that!",
        ["start gpt-4.1-2025-04-14", "open 0 text", "delta 0 text 'The'", "delta 0 text ' question'",
         "delta 0 text ' \"'", "failed server_error server_error retryable=True"],
    ),
    "anthropic": (
        "overloaded_after_text.sse",
        "Overloaded",
        ["start claude-sonnet-4-5", "open 0 text", "delta 0 text 'Partial ans'", "delta 0 text 'wer'",
         "failed overloaded overloaded_error retryable=True"],
    ),
    "openai-responses": (
        "error_nested_after_text.sse",
        "Our servers are currently overloaded. Please try again later.",
        ["start gpt-5-2025-08-07", "open 0 text", "delta 0 text 'Partial '", "delta 0 text 'answer'",
         "failed overloaded server_is_overloaded retryable=True"],
    ),
    "gemini": (
        "unframed_error_tail.sse",  # an unframed JSON body: the one SSE case without data lines
        "The model is overloaded. Please try again later.",
        ["start gemini-2.5-flash", "open 0 text", "delta 0 text 'The capital'", "delta 0 text ' of France is'",
         "failed overloaded UNAVAILABLE retryable=True"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("dialect", sorted(SSE_CASES))
def test_an_echo_in_an_sse_error_ends_as_the_marker_would(dialect: str) -> None:
    name, message, expected = SSE_CASES[dialect]
    body = (TRANSCRIPTS / dialect / name).read_bytes()
    assert body.count(message.encode()) == 1
    echoed = body.replace(message.encode(), f"{message} (key {SECRET})".encode())
    plain = body.replace(message.encode(), f"{message} (key {M})".encode())
    assert echoed != plain and SECRET.encode() in echoed
    _check(dialect, echoed, plain, expected)
    _, events, _ = _recorded(dialect, echoed, 3)
    assert isinstance(events[-1], StreamError) and events[-1].error.message == f"{message} (key {M})"


def _bedrock_exception(key: str) -> bytes:
    return exc("validationException", {"message": f"The security token {key} included in the request is invalid."})


def test_a_bedrock_exception_that_echoes_the_key_fails_as_without_the_echo() -> None:
    """The issue's case: the echo made it ``interrupted / transport`` (the frame, rewritten on bytes, no
    longer matched its length); now it is the exception's own ``failed / invalid_request``, and the frame
    stored is the one the provider would have sent with the marker, byte for byte."""
    echoed = START + text(0, "Hi") + _bedrock_exception(SECRET)
    plain = START + text(0, "Hi") + _bedrock_exception(M)
    expected = [
        "start None",
        "open 0 text",
        "delta 0 text 'Hi'",
        "failed invalid_request validationException retryable=False",
    ]
    _check("bedrock-converse", echoed, plain, expected)
    entries, events, _ = _recorded("bedrock-converse", echoed, 9)
    assert [e.frame for e in entries] == [START, text(0, "Hi"), _bedrock_exception(M)]
    assert [e.offset for e in entries] == [0, len(START), len(START) + len(text(0, "Hi"))]
    assert isinstance(events[-1], StreamError)
    assert events[-1].error.message == f"The security token {M} included in the request is invalid."


def test_a_key_in_a_header_value_is_redacted_and_the_other_headers_keep_their_bytes() -> None:
    headers = {":event-type": "contentBlockDelta", ":content-type": "application/json", ":message-type": "event"}
    payload = b'{"contentBlockIndex":0,"delta":{"text":"Hi"},"p":"x"}'

    def frame(key: str) -> bytes:
        # A short (int16) header before the string one: re-framing must keep its type, not widen it.
        head = b"\x07x-short\x03\x00\x07" + b"\x08x-echoed\x07" + struct.pack(">H", len(key)) + key.encode()
        own = encode_frame(headers, b"")
        own_head = own[12 : 12 + struct.unpack(">I", own[4:8])[0]]
        all_head = own_head + head
        prelude = struct.pack(">II", 16 + len(all_head) + len(payload), len(all_head))
        body = prelude + struct.pack(">I", crc32(prelude)) + all_head + payload
        return body + struct.pack(">I", crc32(body))

    echoed, plain = START + frame(SECRET), START + frame(M)
    entries, events, stored = _recorded("bedrock-converse", echoed, 4)
    assert entries[1].frame == frame(M) and entries[1].redacted and SECRET not in stored
    _same(events, _plain("bedrock-converse", plain))
    assert audit_attempt("req_t", 1, entries, events).ok


def test_a_fault_after_a_redacted_frame_cites_the_offset_it_came_at_and_replays() -> None:
    """The redacted frame is stored shorter than it came: the event after it keeps its own offset, and the
    replay follows the stored offsets, so a message citing one is the same on both sides."""
    bad = ev("contentBlockDelta", {"contentBlockIndex": 0, "delta": "not an object"})
    echoed = START + text(0, f"key {SECRET}") + bad
    entries, events, _ = _recorded("bedrock-converse", echoed, 11)
    at = len(START) + len(text(0, f"key {SECRET}"))
    assert [e.offset for e in entries] == [0, len(START), at]
    assert [e.redacted for e in entries] == [False, True, False]
    assert briefs(events) == [
        "start None", "open 0 text", f"delta 0 text 'key {M}'", "failed protocol None retryable=False",
    ]  # fmt: skip
    assert isinstance(events[-1], StreamError) and f"raw event 3 (byte {at})" in events[-1].error.message
    audit = audit_attempt("req_t", 1, entries, events)
    assert audit.ok, audit


def test_a_broken_frame_and_an_unfinished_one_are_masked_in_place() -> None:
    """Bytes that never became a message are stored with each secret masked to its own length: the fault
    (a CRC mismatch, the dropped count) is the same as the live one, and replays."""
    frame = text(0, f"key {SECRET}")
    broken = frame[:-1] + bytes([frame[-1] ^ 1])
    entries, events, stored = _recorded("bedrock-converse", START + broken, 6)
    assert SECRET not in stored and entries[-1].redacted and len(entries[-1].frame or b"") == len(broken)
    assert briefs(events)[-1] == "failed protocol None retryable=False"
    assert isinstance(events[-1], StreamError) and "message CRC mismatch" in events[-1].error.message
    assert audit_attempt("req_t", 1, entries, events).ok

    cut = frame[:-3]
    entries, events, stored = _recorded("bedrock-converse", START + cut, 6)
    tail = entries[-1]
    assert SECRET not in stored and tail.kind == "tail" and tail.redacted and len(tail.data_bytes or b"") == len(cut)
    assert isinstance(events[-1], StreamError) and f"({len(cut)} bytes of an unfinished event dropped)" in (
        events[-1].error.message
    )
    assert audit_attempt("req_t", 1, entries, events).ok


def test_without_a_secret_the_decoder_keeps_every_frame_as_it_came() -> None:
    d = EventStreamDecoder()
    d.redact_with(Redactor(["short"]))  # a placeholder: nothing to redact
    body = START + text(0, "plain")
    assert [e.frame for e in d.feed(body)] == [START, text(0, "plain")]
    with pytest.raises(ValueError, match="between messages"):
        d.feed(START[:5])
        d.resume_at(0)


def _with_header(name: bytes, times: int = 1) -> bytes:
    """A text delta that carries ``times`` extra string headers called ``name``."""
    own = encode_frame({":event-type": "contentBlockDelta", ":message-type": "event"}, b"")
    head = own[12 : 12 + struct.unpack(">I", own[4:8])[0]] + (bytes([len(name)]) + name + b"\x07\x00\x01v") * times
    payload = b'{"contentBlockIndex":0,"delta":{"text":"Hi"}}'
    prelude = struct.pack(">II", 16 + len(head) + len(payload), len(head))
    body = prelude + struct.pack(">I", crc32(prelude)) + head + payload
    return body + struct.pack(">I", crc32(body))


def test_a_key_as_a_header_name_is_masked_in_the_stored_frame() -> None:
    """A name is not a value: the message is delivered as it came, and the stored frame (where the name would
    stay) is masked, so the key is stored nowhere."""
    entries, events, stored = _recorded("bedrock-converse", START + _with_header(SECRET.encode()), 8)
    assert SECRET not in stored and entries[1].redacted and M.encode() in (entries[1].frame or b"")
    assert briefs(events) == [
        "start None",
        "open 0 text",
        "delta 0 text 'Hi'",
        "interrupted transport None retryable=False",
    ]


def test_a_fault_that_names_a_header_holding_the_key_says_the_marker() -> None:
    entries, events, stored = _recorded("bedrock-converse", START + _with_header(SECRET.encode(), times=2), 8)
    assert SECRET not in stored and entries[-1].redacted
    assert isinstance(events[-1], StreamError)
    masked = M.ljust(len(SECRET), "*")  # the bytes of a broken message are masked, and its fault names them so
    assert events[-1].error.message == f"event-stream message at byte {len(START)}: header '{masked}' appears twice"
    assert audit_attempt("req_t", 1, entries, events).ok

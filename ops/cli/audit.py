"""``sluice audit``: prove that a request's two logs agree by normalizing its raw log again.

Rule: for every attempt, the raw provider events (re-framed as a ``text/event-stream`` body that decodes
to exactly the recorded events, or, for AWS event-stream frames, their recorded bytes (as they came, or as
framed again with a secret redacted) at their recorded byte offsets, each fed with its recorded receive time)
go through the current normalizer with the dialect and provider the attempt's ``stream.start`` names;
the result must equal the stored normalized stream event for event (seq, raw refs, payloads; ``ts``
is reported but not judged), and the final attempt's assembled result must hash to the status record's
``result_hash``. An attempt the raw events alone do not end (a timer, a cancel, a lost worker, an HTTP
error, a connection that broke) is *explained*: its recorded terminal reason, applied where the raw
events stop, must reproduce the stored terminal. Anything else is a mismatch, reported at the first
diverging seq with both sides; ``audit`` then exits 1.

Output checks (contract 1.3) are recomputed the same way: an attempt whose stored ``stream.start`` names a
policy is replayed with the declarations the status record keeps (``checks``) under that policy, so every
verdict (each tool call's ``block.stop``, the answer's terminal) is judged with the events; a verdict that
disagrees is the first divergence, reported as such. The status record's ``invalid_calls`` and
``answer_check`` must be the replay's; the validator it names is shown beside the one replaying.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sluice.normalizer.adapters import DIALECTS
from sluice.normalizer.assemble import assemble
from sluice.normalizer.checks import Checker, SchemaProblem, ValidatorCache, validator_version
from sluice.normalizer.eventstream import EventStreamDecoder
from sluice.normalizer.http_errors import classify_http_error
from sluice.normalizer.limits import Limits
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.normalizer.stream import Normalizer
from sluice.schemas.checks import CheckSpec, decode_checks
from sluice.schemas.events import (
    BlockStop,
    ErrorInfo,
    Event,
    StreamDone,
    StreamError,
    StreamStart,
    StreamWarning,
    Verdict,
    decode_event,
)
from sluice.schemas.keys import Position
from sluice.schemas.raw import RawEntry
from sluice.schemas.result import Result, result_hash
from sluice.schemas.states import TERMINAL_STATES

__all__ = [
    "AttemptAudit",
    "Divergence",
    "RawEntry",
    "Reframer",
    "RequestAudit",
    "audit_archived",
    "audit_attempt",
    "audit_request",
    "configure_parser",
    "parse_duration",
    "run_from_args",
    "sse_body",
]

# Terminal categories sluice itself records when the stream ends outside the provider's data; only these
# may explain an attempt whose raw SSE events do not end it. Without any SSE event (an HTTP error, a
# request never sent) any recorded category explains the attempt.
_OUTSIDE_CATEGORIES = frozenset({"transport", "timeout", "cancelled", "worker_lost", "limit_exceeded"})
_MAX_PAD_LINE = 64 * 1024  # padding comments stay far below any line cap
_MAX_ID = 2**64 - 1
_ENC = msgspec.json.Encoder()
_REPLACEMENT = "\ufffd".encode()


# -- re-framing ----------------------------------------------------------------------------------------


def _field(name: bytes, value: bytes) -> bytes:
    # WHATWG: one space after the colon is dropped, so a value that starts with a space needs one more.
    return name + (b": " if value[:1] == b" " else b":") + value + b"\n"


def _padding(n: int) -> bytes:
    """``n`` bytes that dispatch nothing: comment lines (and a lone blank line for the last byte)."""
    out = bytearray()
    while n > 0:
        if n == 1:
            out += b"\n"  # a blank line with an empty data buffer fires nothing
            break
        size = min(n, _MAX_PAD_LINE)
        if n - size == 1:
            size -= 1
        out += b":" + b" " * (size - 2) + b"\n"
        n -= size
    return bytes(out)


class Reframer:
    """Re-frames recorded SSE events one by one as a body that an ``SSEDecoder`` decodes back to the same
    (event, data, id, index), each at its recorded byte offset when the original framing left room for it
    (comments pad the gaps), so messages that cite offsets come out the same.

    ``invalid_utf8`` names events whose data the provider sent as invalid UTF-8: the raw log keeps them
    decoded with U+FFFD, so each U+FFFD is written back as one invalid byte (``\\xff``), which decodes to
    the same text and raises the same flag."""

    def __init__(self, invalid_utf8: Iterable[int] = ()) -> None:
        self.invalid_utf8 = frozenset(invalid_utf8)
        self.position = 0
        self._last_id = ""

    def frame(self, entry: RawEntry) -> bytes:
        if entry.frame is not None:  # an AWS event-stream message: its exact bytes (no gap can occur)
            self.position += len(entry.frame)
            return entry.frame
        out = bytearray()
        if entry.offset is not None and entry.offset > self.position:
            out += _padding(entry.offset - self.position)
        if entry.id != self._last_id:
            out += _field(b"id", entry.id.encode())
            self._last_id = entry.id
        if entry.event != "message":
            out += _field(b"event", entry.event.encode())
        if entry.data_bytes is not None:  # the exact bytes were kept (they were not valid UTF-8)
            data = entry.data_bytes
        else:
            data = entry.data.encode()
            if entry.index in self.invalid_utf8:  # a log from before exact bytes were kept
                data = data.replace(_REPLACEMENT, b"\xff")
        if entry.unframed:  # a JSON object without SSE framing: its lines as they came
            out += data + b"\n"
        else:
            for line in data.split(b"\n"):
                out += _field(b"data", line)
            out += b"\n"
        self.position += len(out)
        return bytes(out)

    def tail(self, entry: RawEntry) -> bytes:
        """The unfinished event the end of the stream cut off, byte for byte, at its offset."""
        out = bytearray()
        if entry.offset is not None and entry.offset > self.position:
            out += _padding(entry.offset - self.position)
        out += entry.data_bytes or b""
        self.position += len(out)
        return bytes(out)


def sse_body(entries: Iterable[RawEntry], *, invalid_utf8: Iterable[int] = ()) -> bytes:
    """The raw log's SSE events (``kind == "sse"``, in index order) as one ``text/event-stream`` body."""
    framer = Reframer(invalid_utf8)
    return b"".join(framer.frame(e) for e in sorted(entries, key=lambda e: e.index) if e.kind == "sse")


# -- one attempt ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Divergence:
    seq: int
    position: int  # 0-based index into the attempt's events
    stored: Event | None
    replayed: Event | None


@dataclass(slots=True)
class AttemptAudit:
    attempt: int
    raw_sse: int
    http_status: int | None
    stored: list[Event]
    replayed: list[Event]
    ending: str  # "provider" | "eof" | "recorded" | "none" | "open"
    explanation: str
    divergence: Divergence | None = None
    problem: str | None = None  # a mismatch that is not an event (e.g. no stream.start)
    ts_differences: int = 0
    checks: str = ""  # the policy the attempt's output was checked under (stream.start's), "" for none

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.problem is None


def _strip_ts(ev: Event) -> Any:
    d = msgspec.to_builtins(ev)
    d.pop("ts", None)
    return d


def _compare(stored: Sequence[Event], replayed: Sequence[Event]) -> tuple[Divergence | None, int]:
    ts_diff = 0
    for i in range(max(len(stored), len(replayed))):
        a = stored[i] if i < len(stored) else None
        b = replayed[i] if i < len(replayed) else None
        if a is None or b is None or _strip_ts(a) != _strip_ts(b):
            # Name the lowest seq in disagreement and what each side holds at that seq (an event
            # missing on one side shows as none, rather than as its neighbour).
            seq = min(ev.seq for ev in (a, b) if ev is not None)
            return Divergence(seq, i, _at_seq(stored, i, seq), _at_seq(replayed, i, seq)), ts_diff
        ts_diff += a.ts != b.ts
    return None, ts_diff


def _at_seq(events: Sequence[Event], start: int, seq: int) -> Event | None:
    return next((ev for ev in events[start:] if ev.seq == seq), None)


def _invalid_utf8_refs(events: Iterable[Event]) -> set[int]:
    """Raw events the stored stream says were invalid UTF-8 (the raw log cannot say it by itself)."""
    refs: set[int] = set()
    for ev in events:
        if (isinstance(ev, StreamWarning) and ev.code == "invalid_utf8") or (
            isinstance(ev, StreamError) and ev.error.category == "protocol" and "not valid UTF-8" in ev.error.message
        ):
            refs.update(ev.raw)
    return refs


def _recorded_end(machine: StreamMachine, term: StreamError) -> list[Event]:
    """Apply a recorded terminal reason where the replay stands, as the worker did."""
    err = term.error
    if err.category == "worker_lost" and machine.seq > 0:
        # A takeover writes this terminal itself (sluice.worker.pipeline.claim), after the lost worker's last seq.
        info = machine.info
        return [
            StreamError(
                stream_id=info.stream_id,
                request_id=info.request_id,
                seq=machine.seq + 1,
                ts=term.ts,
                status="interrupted",
                error=ErrorInfo(category="worker_lost", retryable=False, message=err.message),
            )
        ]
    if term.status == "interrupted":
        return machine.interrupt(err.category, err.message, ts=term.ts, raw=term.raw, retryable=err.retryable)
    return machine.fail(
        err.category,
        err.message,
        ts=term.ts,
        raw=term.raw,
        provider_code=err.provider_code,
        retryable=err.retryable,
        block_index=err.block_index,
    )


def _describe_end(term: Event | None) -> str:
    if not isinstance(term, StreamError):
        return "no error recorded"
    return f"{term.status} / {term.error.category}: {term.error.message}"


def audit_attempt(
    request_id: str,
    attempt: int,
    raw: Sequence[RawEntry],
    stored: Sequence[Event],
    *,
    model: str | None = None,
    limits: Limits | None = None,
    checks: Checker | None = None,
) -> AttemptAudit:
    """Re-normalize one attempt's raw entries and compare with its stored events (pure, no IO); ``checks``:
    the declarations and policy its output is checked under, as the worker checked it."""
    stored = list(stored)
    sse = sorted((e for e in raw if e.kind in ("sse", "frame")), key=lambda e: e.index)
    tail = next((e for e in raw if e.kind == "tail"), None)
    http = next((e for e in raw if e.kind == "http"), None)
    http_status = http.http_status if http else None
    audit = AttemptAudit(attempt, len(sse), http_status, stored, [], "none", "")
    start = stored[0] if stored and isinstance(stored[0], StreamStart) else None
    if start is None:
        audit.problem = "the stored stream does not begin with stream.start"
        audit.divergence = Divergence(stored[0].seq if stored else 1, 0, stored[0] if stored else None, None)
        return audit
    last = stored[-1]
    term = last if isinstance(last, StreamDone | StreamError) else None
    stream_id = f"{request_id}:{attempt}"
    term_ts = term.ts if term is not None else 0

    if start.dialect not in DIALECTS:
        # The attempt never reached a provider (bad job, unknown route, a worker lost before stream.start):
        # its whole stream is the recorded reason on a fresh machine, as the worker wrote it.
        if sse:
            audit.problem = f"{len(sse)} raw provider events recorded for an attempt without a dialect"
        if not isinstance(term, StreamError):
            audit.problem = audit.problem or "an attempt without a dialect must end in stream.error"
            return audit
        machine = StreamMachine(
            StreamInfo(stream_id, request_id, start.provider, start.dialect, attempt, route=start.route or "")
        )
        audit.replayed = _recorded_end(machine, term)
        audit.ending, audit.explanation = "recorded", f"never reached a provider: {_describe_end(term)}"
        audit.divergence, audit.ts_differences = _compare(stored, audit.replayed)
        return audit

    audit.checks = checks.policy if checks is not None else ""
    info = StreamInfo(
        stream_id, request_id, start.provider, start.dialect, attempt, model or None, start.route or "", checks
    )
    invalid = _invalid_utf8_refs(stored)

    def replay() -> tuple[Normalizer, list[Event]]:
        norm = Normalizer(start.dialect, info, limits)
        framer = Reframer(invalid)
        out: list[Event] = []
        # Event-stream frames go at the offsets they came at: a redacted one is stored shorter than it came.
        frames = norm.decoder if isinstance(norm.decoder, EventStreamDecoder) else None
        for entry in sse:
            if frames is not None and entry.offset is not None and not frames.pending:
                frames.resume_at(entry.offset)
            out += norm.feed(framer.frame(entry), entry.ts).events
        if tail is not None and not norm.terminal:
            if frames is not None and tail.offset is not None and not frames.pending:
                frames.resume_at(tail.offset)
            out += norm.feed(framer.tail(tail), tail.ts).events
        return norm, out

    norm, events = replay()
    if norm.terminal:
        audit.replayed, audit.ending = events, "provider"
        te = norm.machine.terminal_event
        audit.explanation = (
            f"the provider's events end it ({te.stop_reason})"
            if isinstance(te, StreamDone)
            else f"the provider's events end it ({_describe_end(te)})"
        )
        audit.divergence, audit.ts_differences = _compare(stored, events)
        return audit
    if term is None:
        # No terminal stored: only a request still running may look like this.
        audit.replayed, audit.ending, audit.explanation = events, "open", "no terminal event stored (still running?)"
        audit.divergence, audit.ts_differences = _compare(stored, events)
        return audit

    if (
        isinstance(term, StreamError)
        and http is not None
        and http.body is not None
        and http_status not in (None, 200)
        and not sse
    ):
        # An HTTP error: its stored (bounded, redacted) body says exactly how it failed.
        fail = classify_http_error(http_status, http.body)
        fresh = Normalizer(start.dialect, info, limits)
        replayed = fresh.fail(
            fail.category, fail.message, term_ts, provider_code=fail.provider_code, retryable=fail.retryable
        )
        audit.replayed, audit.ending = replayed, "http"
        audit.explanation = f"HTTP {http_status}, replayed from the stored body: {_describe_end(term)}"
        audit.divergence, audit.ts_differences = _compare(stored, replayed)
        return audit
    # The raw events stop before a terminal: first try the end of the body (EOF) ...
    eof = events + norm.close(term_ts)
    eof_div, eof_ts = _compare(stored, eof)
    if eof_div is None:
        audit.replayed, audit.ending, audit.ts_differences = eof, "eof", eof_ts
        te = norm.machine.terminal_event
        audit.explanation = "the body ended after the last raw event" + (
            f" ({te.stop_reason})" if isinstance(te, StreamDone) else f" ({_describe_end(te)})"
        )
        return audit
    # ... then the reason the worker recorded for ending it from outside the stream.
    allowed = isinstance(term, StreamError) and (not sse or term.error.category in _OUTSIDE_CATEGORIES)
    if allowed:
        assert isinstance(term, StreamError)
        norm2, events2 = replay()
        rec = events2 + _recorded_end(norm2.machine, term)
        rec_div, rec_ts = _compare(stored, rec)
        where = (
            f"HTTP {http_status}"
            if http_status not in (None, 200) and not sse
            else f"after {_n(len(sse), 'raw event')}"
        )
        audit.explanation = f"ended outside the provider's events {where}: {_describe_end(term)}"
        if rec_div is None or rec_div.position >= eof_div.position:
            audit.replayed, audit.ending, audit.divergence, audit.ts_differences = rec, "recorded", rec_div, rec_ts
            return audit
    else:
        audit.explanation = "the raw events do not end the stream, and the stored terminal is not one sluice " + (
            "records from outside the stream" if isinstance(term, StreamError) else "can produce without them"
        )
    audit.replayed, audit.ending, audit.divergence, audit.ts_differences = eof, "eof", eof_div, eof_ts
    return audit


# -- one request ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestAudit:
    request_id: str
    status: dict[str, str]
    attempts: list[AttemptAudit] = field(default_factory=list)
    stored_hash: str | None = None  # of the stored final attempt
    replayed_hash: str | None = None  # of the replayed final attempt
    problems: list[str] = field(default_factory=list)
    raw_total: int = 0
    events_total: int = 0
    current_version: str = ""

    @property
    def found(self) -> bool:
        return bool(self.status)

    @property
    def ok(self) -> bool:
        return self.found and not self.problems and all(a.ok for a in self.attempts)


def _group(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> dict[int, list[tuple[bytes, dict[bytes, bytes]]]]:
    out: dict[int, list[tuple[bytes, dict[bytes, bytes]]]] = {}
    for entry_id, fields in entries:
        out.setdefault(Position.from_entry_id(entry_id).attempt, []).append((entry_id, fields))
    return out


def check_request(
    request_id: str,
    status: dict[str, str],
    raw_entries: list[tuple[bytes, dict[bytes, bytes]]],
    event_entries: list[tuple[bytes, dict[bytes, bytes]]],
    *,
    limits: Limits | None = None,
    current_version: str = "",
) -> RequestAudit:
    """The whole request from what Redis holds (pure, no IO)."""
    audit = RequestAudit(request_id, status, current_version=current_version)
    audit.raw_total, audit.events_total = len(raw_entries), len(event_entries)
    if not status:
        audit.problems.append("no status record (unknown request, or its keys expired)")
        return audit
    for name, have in (("raw_count", len(raw_entries)), ("event_count", len(event_entries))):
        want = status.get(name, "")
        if want.isdigit() and int(want) != have:
            trimmed = status.get("maxlen", "0") not in ("", "0")
            audit.problems.append(
                f"the status record counts {want} {name.removesuffix('_count')} entries but the stream holds {have}"
                + (f" (streams are capped at MAXLEN {status['maxlen']}: they were trimmed)" if trimmed else "")
            )
    raw_by = _group(raw_entries)
    ev_by = _group(event_entries)
    model = status.get("model") or None
    spec: CheckSpec | None = None
    if status.get("checks"):
        try:
            spec = decode_checks(status["checks"])
        except msgspec.DecodeError as exc:
            audit.problems.append(f"the status record's checks are not a check spec ({exc})")
    cache = ValidatorCache()
    for attempt in sorted(set(raw_by) | set(ev_by)):
        try:
            stored = [decode_event(f[b"event"]) for _, f in ev_by.get(attempt, [])]
        except (msgspec.ValidationError, msgspec.DecodeError, KeyError) as exc:
            audit.problems.append(f"attempt {attempt}: a stored event is not a contract event ({exc})")
            continue
        raw = [RawEntry.from_redis(i, f) for i, f in raw_by.get(attempt, [])]
        asked = model
        start = stored[0] if stored else None
        if isinstance(start, StreamStart) and start.route not in (msgspec.UNSET, status.get("route")):
            # A fallback route's attempt asked for that route's model, which the status does not hold.
            asked = start.model
        checks, problem = _attempt_checks(spec, start, cache)
        one = audit_attempt(request_id, attempt, raw, stored, model=asked, limits=limits, checks=checks)
        one.problem = one.problem or problem
        audit.attempts.append(one)
    if not audit.attempts:
        audit.problems.append("no events stored")
        return audit
    final = audit.attempts[-1]
    state = status.get("state", "")
    if state in TERMINAL_STATES:
        for a in audit.attempts:
            if a.ending == "open":
                a.problem = "the request is finished but this attempt has no terminal event"
        audit.stored_hash = result_hash(assemble(final.stored))
        audit.replayed_hash = result_hash(assemble(final.replayed))
        recorded = status.get("result_hash", "")
        if recorded != audit.stored_hash:
            audit.problems.append(f"the status record's result_hash {recorded or '(none)'} is not the stored events'")
        if recorded != audit.replayed_hash:
            audit.problems.append(f"the status record's result_hash {recorded or '(none)'} is not the replay's")
        if status.get("attempt", "").isdigit() and int(status["attempt"]) != final.attempt:
            audit.problems.append(f"status names attempt {status['attempt']}, the logs end at {final.attempt}")
        audit.problems += _verdict_counts(status, assemble(final.replayed))
    else:
        audit.problems.append(f"the request is {state or 'in an unknown state'}: only finished requests are audited")
    return audit


def _attempt_checks(
    spec: CheckSpec | None, start: Event | None, cache: ValidatorCache
) -> tuple[Checker | None, str | None]:
    """The checker an attempt's replay runs with: the status record's declarations under the policy the
    attempt's stream.start names; or why there is none to run with (a problem)."""
    policy = start.checks if isinstance(start, StreamStart) else msgspec.UNSET
    if isinstance(policy, msgspec.UnsetType):
        return None, None
    if spec is None:
        return None, f"stream.start says the output was checked ({policy}), the status record keeps no checks"
    try:
        return Checker.compile(spec, policy, cache), None
    except SchemaProblem as exc:
        return None, f"the status record's checks cannot be compiled: {exc}"


def _verdict_counts(status: dict[str, str], replayed: Result) -> list[str]:
    """The status record's verdict fields against the replay's result."""
    problems: list[str] = []
    want_calls = "" if replayed.invalid_calls is None else str(replayed.invalid_calls)
    if status.get("invalid_calls", "") != want_calls:
        problems.append(
            f"the status record counts {status.get('invalid_calls') or 'no'} invalid calls, the replay "
            f"{want_calls or 'checks none'}"
        )
    answer = replayed.answer
    want_answer = "" if answer is None else ("valid" if answer.valid else "invalid")
    if status.get("answer_check", "") != want_answer:
        problems.append(
            f"the status record's answer_check is {status.get('answer_check') or 'unset'}, the replay's "
            f"{want_answer or 'unset'}"
        )
    return problems


async def audit_request(
    redis: Any, keys: Any, request_id: str, *, limits: Limits | None = None, current_version: str = ""
) -> RequestAudit:
    """Read one request's status, raw and events streams and check them."""
    rk = keys.request(request_id)
    # One slot (the request's hash tag), so a transaction works on a cluster too.
    async with redis.pipeline(transaction=True) as p:
        p.hgetall(rk.status)
        p.xrange(rk.raw, "-", "+")
        p.xrange(rk.events, "-", "+")
        raw_status, raw_entries, event_entries = await p.execute()
    status = {k.decode(): v.decode("utf-8", "replace") for k, v in raw_status.items()}
    return check_request(request_id, status, raw_entries, event_entries, limits=limits, current_version=current_version)


async def audit_archived(
    dest: Any,
    request_id: str,
    *,
    limits: Limits | None = None,
    current_version: str = "",
    tables: Mapping[str, Any] | None = None,
) -> RequestAudit:
    """Read one request from the archive (its index row proven: ``sluice.archive.proof``, ``tables`` the
    route price tables a cost is recomputed with) and check it exactly as from Redis. Raises
    ``ArchiveCorrupt`` (missing, truncated, altered: the archive's fault, never reported as a normalizer
    mismatch) and ``DestinationError``."""
    from sluice.archive.reader import read_archived

    req = await read_archived(dest, request_id, tables=tables)
    return check_request(
        request_id, req.status_text, req.raw, req.events, limits=limits, current_version=current_version
    )


# -- output ----------------------------------------------------------------------------------------------


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _event_json(ev: Event | None) -> str:
    return "(none)" if ev is None else _ENC.encode(ev).decode()


def format_request(audit: RequestAudit) -> list[str]:
    st = audit.status
    verdict = "OK" if audit.ok else "MISMATCH"
    lines = [f"audit {audit.request_id}: {verdict}"]
    if not audit.found:
        return [*lines, *(f"  {p}" for p in audit.problems)]
    version = st.get("normalizer_version", "?")
    replay_v = audit.current_version or "?"
    lines.append(
        f"  state {st.get('state', '?')} · route {st.get('route', '?')} · model {st.get('model') or '-'} · "
        f"normalizer {version} (replayed with {replay_v})"
    )
    if st.get("checks"):
        counted = f"{st.get('invalid_calls') or 'no'} invalid calls" + (
            f", answer {st['answer_check']}" if st.get("answer_check") else ""
        )
        lines.append(f"  checks: {counted} (judged by {st.get('validator') or '?'})")
    lines.append(
        f"  streams: raw {audit.raw_total} entries (status says {st.get('raw_count', '?')}), events "
        f"{audit.events_total} (status says {st.get('event_count', '?')})"
    )
    for a in audit.attempts:
        start = a.stored[0] if a.stored and isinstance(a.stored[0], StreamStart) else None
        dialect = f"{start.dialect}/{start.provider}" if start else "?"
        http = f", HTTP {a.http_status}" if a.http_status is not None else ""
        mark = "ok" if a.ok else "MISMATCH"
        lines.append(
            f"  attempt {a.attempt} [{dialect}]: {_n(a.raw_sse, 'raw event')}{http}; {len(a.stored)} stored / "
            f"{len(a.replayed)} replayed events: {mark}"
        )
        lines.append(f"    {a.explanation}")
        if a.checks:
            lines.append(f"    {_checks_line(a)}")
        if a.ts_differences:
            lines.append(f"    note: ts differs on {a.ts_differences} event(s) (receive times are not judged)")
        if a.problem:
            lines.append(f"    problem: {a.problem}")
        if a.divergence is not None:
            d = a.divergence
            lines.append(f"    first divergence at seq {d.seq}{_verdict_note(d)}:")
            lines.append(f"      stored:   {_event_json(d.stored)}")
            lines.append(f"      replayed: {_event_json(d.replayed)}")
    if audit.stored_hash is not None:
        recorded = st.get("result_hash") or "(none)"
        if audit.replayed_hash == recorded == audit.stored_hash:
            lines.append(f"  result hash: {recorded} (status record = stored events = replay)")
        else:
            lines.append("  result hash: DIFFER")
            lines.append(f"    status record  {recorded}")
            lines.append(f"    stored events  {audit.stored_hash}")
            lines.append(f"    replay         {audit.replayed_hash}")
    lines += [f"  problem: {p}" for p in audit.problems]
    if not audit.ok and version != replay_v:
        lines.append(f"  note: the stream was written by {version}; a different normalizer may explain the mismatch")
    return lines


def _checks_line(a: AttemptAudit) -> str:
    """What the attempt's replay concluded about its output (its verdicts, recomputed)."""
    verdicts = [e.verdict for e in a.replayed if isinstance(e, BlockStop) and isinstance(e.verdict, Verdict)]
    invalid = sum(not v.valid for v in verdicts)
    term = a.replayed[-1] if a.replayed else None
    answer = term.answer if isinstance(term, StreamDone | StreamError) else msgspec.UNSET
    said = f"checks ({a.checks}, recomputed with {validator_version()}): {_n(len(verdicts), 'tool call')} checked"
    said += f", {invalid} invalid"
    if isinstance(answer, Verdict):
        said += f"; the answer {'valid' if answer.valid else 'invalid'}"
    return said


def _verdict_note(d: Divergence) -> str:
    """`` (a verdict)`` when the two sides differ only in what the checks concluded."""

    def bare(ev: Event | None) -> Any:
        doc = msgspec.to_builtins(ev) if ev is not None else None
        if isinstance(doc, dict):
            for name in ("ts", "verdict", "answer"):
                doc.pop(name, None)
        return doc

    if d.stored is None or d.replayed is None or bare(d.stored) != bare(d.replayed):
        return ""
    return " (the verdicts disagree)"


def summary_line(audit: RequestAudit) -> str:
    if not audit.found:
        return f"missing   {audit.request_id}  (keys expired or never existed)"
    if audit.status.get("state") not in TERMINAL_STATES:
        return f"running   {audit.request_id}  (queued again since it finished: skipped)"
    verdict = "ok" if audit.ok else "MISMATCH"
    st = audit.status
    detail = ""
    if not audit.ok:
        bad = next((a for a in audit.attempts if not a.ok), None)
        if bad is not None and bad.divergence is not None:
            detail = f"  attempt {bad.attempt}: first divergence at seq {bad.divergence.seq}"
        elif bad is not None and bad.problem:
            detail = f"  attempt {bad.attempt}: {bad.problem}"
        elif audit.problems:
            detail = f"  {audit.problems[0]}"
    ends = ",".join(a.ending for a in audit.attempts)
    return (
        f"{verdict:<9} {audit.request_id}  {st.get('state', '?')}  attempts {len(audit.attempts)} ({ends})  "
        f"raw {audit.raw_total}  events {audit.events_total}{detail}"
    )


# -- the command -------------------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_duration(text: str) -> int:
    """``90s``, ``10m``, ``2h``, ``1h30m``, ``7d`` -> milliseconds. Raises ``ValueError``."""
    s = text.strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_MS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s) or total <= 0:
        raise ValueError(f"bad duration {text!r}: use e.g. 30s, 10m, 2h, 1h30m, 7d")
    return int(total)


def configure_parser(p: argparse.ArgumentParser) -> None:
    from sluice.cli.requests import redis_args

    p.add_argument("request_id", nargs="?", help="the request to audit")
    p.add_argument("--since", metavar="DURATION", help="audit the requests finished since then (10m, 2h)")
    p.add_argument("--limit", type=int, default=10_000, help="with --since: at most this many requests")
    p.add_argument("--quiet", "-q", action="store_true", help="with --since: print only mismatches and the summary")
    p.add_argument(
        "--archive", metavar="URL", help="audit from the archive (a directory or object-store URL) instead of Redis"
    )
    redis_args(p)


def run_from_args(args: argparse.Namespace) -> int:
    from sluice.cli.requests import CommandError, config_from_args, run_with_client

    if bool(args.request_id) == bool(args.since):
        raise CommandError("give a REQUEST_ID or --since DURATION (not both)")
    since_ms = 0
    if args.since:
        try:
            since_ms = parse_duration(args.since)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    config = config_from_args(args)
    limits = config.limits
    from sluice.normalizer.stream import NORMALIZER_VERSION

    if args.archive:
        from sluice.worker.cost import route_tables

        return _run_archived(args, since_ms, limits, NORMALIZER_VERSION, route_tables(config))

    async def one(c: Any) -> int:
        audit = await audit_request(c.redis, c.keys, args.request_id, limits=limits, current_version=NORMALIZER_VERSION)
        if not audit.found:
            raise CommandError(f"unknown request {args.request_id} (no status record; keys expire after retention)")
        state = audit.status.get("state", "")
        if state not in TERMINAL_STATES:
            raise CommandError(f"request {args.request_id} is {state or 'in no state'}: audit checks finished requests")
        print("\n".join(format_request(audit)))
        return 0 if audit.ok else 1

    async def many(c: Any) -> int:
        start = int(time.time() * 1000) - since_ms
        entries = []
        for shard in (await c.connect()).shards:  # every terminal shard (one on the single-instance layout)
            entries += await c.redis.xrange(shard.terminal, f"{start}-0", "+", count=args.limit)
        entries.sort(key=lambda e: Position.from_entry_id(e[0]))
        del entries[args.limit or len(entries) :]
        seen: dict[str, None] = {}
        for _, f in entries:
            seen.setdefault(f.get(b"request_id", b"").decode(), None)
        counts = {"ok": 0, "mismatch": 0, "missing": 0, "running": 0}
        for rid in seen:
            if not rid:
                continue
            audit = await audit_request(c.redis, c.keys, rid, limits=limits, current_version=NORMALIZER_VERSION)
            if not audit.found:
                key = "missing"
            elif audit.status.get("state") not in TERMINAL_STATES:
                key = "running"  # requeued since it finished: its new attempt is not over yet
            else:
                key = "ok" if audit.ok else "mismatch"
            counts[key] += 1
            if not args.quiet or key == "mismatch":
                print(summary_line(audit))
            sys.stdout.flush()
        total = sum(counts.values())
        running = f", {counts['running']} running again (skipped)" if counts["running"] else ""
        print(
            f"audited {total} request(s) finished in the last {args.since}: {counts['ok']} ok, "
            f"{counts['mismatch']} mismatched, {counts['missing']} missing (expired){running}"
        )
        return 1 if counts["mismatch"] else 0

    return run_with_client(args, one if args.request_id else many)


def _run_archived(
    args: argparse.Namespace, since_ms: int, limits: Limits, version: str, tables: Mapping[str, Any]
) -> int:
    """``audit --archive URL``: the same checks over what the archive holds (no Redis), each index row
    proven against its object (``tables``: the configuration's route price tables)."""
    import anyio

    from sluice.archive.cli import destination_from
    from sluice.archive.reader import index_rows
    from sluice.archive.record import ArchiveCorrupt
    from sluice.archive.store import DestinationError
    from sluice.cli.requests import CommandError

    dest = destination_from(args.archive)

    async def one() -> int:
        try:
            audit = await audit_archived(dest, args.request_id, limits=limits, current_version=version, tables=tables)
        except ArchiveCorrupt as exc:
            if exc.kind == "missing":
                raise CommandError(f"request {args.request_id} is not in the archive ({exc.detail})") from None
            print(f"audit {args.request_id}: ARCHIVE {exc.kind.upper()}\n  {exc.detail}")
            return 1
        print("\n".join(format_request(audit)))
        return 0 if audit.ok else 1

    async def many() -> int:
        now = int(time.time() * 1000)
        rows, bad = await index_rows(dest, now - since_ms, now)
        counts = {"ok": 0, "mismatch": 0, "damaged": 0}
        for name in bad:
            counts["damaged"] += 1
            print(f"ALTERED   {name}  (an index row that does not decode)")
        for row in rows[: args.limit or len(rows)]:
            try:
                audit = await audit_archived(
                    dest, row.request_id, limits=limits, current_version=version, tables=tables
                )
            except ArchiveCorrupt as exc:
                counts["damaged"] += 1
                print(f"{exc.kind.upper():<9} {row.request_id}  {exc.detail}")
                continue
            key = "ok" if audit.ok else "mismatch"
            counts[key] += 1
            if not args.quiet or key == "mismatch":
                print(summary_line(audit))
        total = sum(counts.values())
        print(
            f"audited {total} archived request(s) finished in the last {args.since}: {counts['ok']} ok, "
            f"{counts['mismatch']} mismatched, {counts['damaged']} damaged archive object(s)"
        )
        return 1 if counts["mismatch"] or counts["damaged"] else 0

    try:
        return anyio.run(one if args.request_id else many)
    except DestinationError as exc:
        raise CommandError(str(exc)) from None

"""One attempt's HTTP side: send the provider request, read the body under separate timers, feed the
normalizer, and store its output before reading on (one task per stream, no queue between them).

Rule: timers are separate and name themselves when they fire: ``connect``; ``first_byte`` (until the
response headers and the first SSE event); ``idle`` (time without a content event: bytes, pings and
comments do not reset it, so a server trickling one byte a second still trips it); ``total``. Leaving
this function by any path closes the upstream response, so cancellation reaches the provider. The HTTP
layer's typed failures become the stream's terminal here, in one place (``_transport_failure``). Storing
before reading on makes reading pause when Redis is slow: the HTTP client's buffer is bounded, so the wait
becomes TCP back-pressure on the provider, never a buffer without end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import msgspec

from sluice.normalizer.http_errors import classify_http_error
from sluice.normalizer.redact import RedactingStream, Redactor
from sluice.normalizer.requests.base import ProviderRequest
from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import Event
from sluice.worker.append.log import PendingBatch
from sluice.worker.clock import now_ms
from sluice.worker.config import Timeouts
from sluice.worker.http import NOT_SENT, HttpClient, HTTPError, UpstreamResponse
from sluice.worker.observability.telemetry import NO_ATTEMPT, AttemptTelemetry

__all__ = [
    "AttemptReport",
    "pump",
    "retry_delay_in_body",
]

# Response headers worth keeping in the raw log; everything else (cookies, tokens) stays out.
_KEEP_HEADERS = (
    "content-type",
    "date",
    "request-id",
    "x-request-id",
    "openai-processing-ms",
    "anthropic-organization-id",
    "retry-after",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "server",
    "cf-ray",
)
_MAX_ERROR_BODY = 64 * 1024
_SLICE = 16 * 1024


@dataclass(slots=True)
class AttemptReport:
    """What the retry policy needs from the HTTP side beyond the terminal event."""

    retry_after: float | None = None


def retry_delay_in_body(body: bytes) -> float | None:
    """Gemini's hint, which the real API gives only in its error body: ``error.details[*].retryDelay`` of a
    ``google.rpc.RetryInfo`` ("47.6s"). None when the body has none."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    details = (
        doc.get("error", {}).get("details") if isinstance(doc, dict) and isinstance(doc.get("error"), dict) else None
    )
    for d in details if isinstance(details, list) else ():
        delay = d.get("retryDelay") if isinstance(d, dict) else None
        if isinstance(delay, str) and delay.endswith("s"):
            try:
                return max(0.0, float(delay[:-1]))
            except ValueError:
                return None
    return None


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: ignored, the back-off policy applies


async def pump(
    client: HttpClient,
    base_url: str,
    req: ProviderRequest,
    norm: Normalizer,
    emit: Callable[[PendingBatch], Awaitable[None]],
    timeouts: Timeouts,
    report: AttemptReport,
    tel: AttemptTelemetry = NO_ATTEMPT,
    secrets: Redactor | None = None,
) -> None:
    """Run the attempt until the normalizer is terminal, storing each batch through ``emit`` before reading
    on. Everything from the provider (headers, error body, stream) passes ``secrets`` before it is stored:
    the stream where its framing allows (``Normalizer.redact_with``). Timer
    expiries and transport failures become the stream's terminal event here; cancellation propagates (the
    caller writes its terminal)."""
    secrets = secrets or Redactor(())
    started = time.monotonic()
    total_dl = started + timeouts.total
    first_dl = started + timeouts.first_byte
    url = base_url.rstrip("/") + req.path

    def timer_fired(name: str, seconds: float) -> PendingBatch:
        return PendingBatch.of(norm.interrupt("timeout", f"{name} timeout ({seconds:g}s) fired", now_ms()))

    response: UpstreamResponse | None = None
    try:
        with anyio.move_on_after(max(0.0, min(total_dl, first_dl) - time.monotonic())):
            response = await client.open(req.method, url, req.headers, req.body, timeouts.connect)
        if response is None:  # the head's timer fired
            which = ("total", timeouts.total) if total_dl <= first_dl else ("first_byte", timeouts.first_byte)
            await emit(timer_fired(*which))
            return
    except HTTPError as exc:
        await emit(PendingBatch.of(_transport_failure(norm, exc, responded=False)))
        return

    try:
        tel.on_response(response.status_code)
        ms = _retry_after(response.headers.get("retry-after-ms"))
        report.retry_after = ms / 1000 if ms is not None else _retry_after(response.headers.get("retry-after"))
        meta = PendingBatch()
        headers = {k: secrets.redact_text(v) for k, v in response.headers.items() if k.lower() in _KEEP_HEADERS}
        record = msgspec.json.encode({"status": response.status_code, "headers": headers}).decode()
        if response.status_code != 200:
            # Kept (bounded, redacted) in the raw record, so `sluice audit` replays the failure from it.
            body = secrets.redact(await _read_bounded(response, _MAX_ERROR_BODY, total_dl))
            meta.add_raw(0, "http", "http.response", record, "", 0, now_ms(), extra_bytes={"body": body})
            if report.retry_after is None:
                report.retry_after = retry_delay_in_body(body)
            fail = classify_http_error(response.status_code, body)
            for ev in norm.fail(
                fail.category,
                fail.message,
                now_ms(),
                provider_code=fail.provider_code,
                retryable=fail.retryable,
            ):
                meta.add_event(ev)
            await emit(meta)
            return
        meta.add_raw(0, "http", "http.response", record, "", 0, now_ms())
        await emit(meta)
        await _read_body(
            response, norm, emit, timeouts, total_dl, first_dl, timer_fired, tel, norm.redact_with(secrets)
        )
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()


async def _read_body(
    response: UpstreamResponse,
    norm: Normalizer,
    emit: Callable[[PendingBatch], Awaitable[None]],
    timeouts: Timeouts,
    total_dl: float,
    first_dl: float,
    timer_fired: Callable[[str, float], PendingBatch],
    tel: AttemptTelemetry,
    redacting: RedactingStream,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Read the body into ``norm`` until its terminal, storing what each read made before reading on. When
    the stream gave no terminal, the body's end, a broken connection or a fired timer makes it."""
    timers = _Timers(timeouts, total_dl, first_dl)
    window = _ReadWindow(tel, norm.counts)
    now = clock()
    try:
        while not norm.terminal:
            try:
                # Everything buffered comes at once: while the last batch was being stored, the next piled up.
                chunk = await response.receive(timers.deadline)
            except HTTPError as exc:
                now = clock()
                await _feed_held(norm, redacting, emit, window, now)
                await emit(_broken(norm, exc))
                return
            now = clock()
            if chunk == b"":
                await _feed_held(norm, redacting, emit, window, now)
                await emit(_ended(norm))
                return
            if chunk is not None:
                # Whatever arrived is kept, even when a timer expires right after it.
                window.read(now, len(chunk))
                data = redacting.feed(chunk)
                made_events = False  # one gap per read, at its first slice that makes events
                # Large reads go in slices, so one append call (and what it holds in memory) stays bounded.
                for start in range(0, len(data), _SLICE):
                    ts = now_ms()
                    raw, events = norm.feed(data[start : start + _SLICE] if len(data) > _SLICE else data, ts)
                    batch = PendingBatch.normalized(raw, events, ts)
                    timers.fed(now, raw, events)
                    if events and not made_events:
                        made_events = True
                        window.made_events(now)
                    if window.firsts and (raw or events):
                        window.fed(now, len(raw), events)
                    if len(batch):
                        await emit(batch)
                    if norm.terminal:
                        return
            if chunk is None or now >= timers.deadline:
                await emit(timer_fired(*timers.fired(now)))
                return
    finally:
        window.close(now)


class _Timers:
    """The body's timers (the module's rule): ``first_byte`` until the first provider event, then ``idle``
    from the last content event, ``total`` throughout. ``deadline``: when the next one fires."""

    __slots__ = ("_first", "_idle", "_seen_event", "_timeouts", "_total", "deadline")

    def __init__(self, timeouts: Timeouts, total_dl: float, first_dl: float) -> None:
        self._timeouts, self._total, self._first = timeouts, total_dl, first_dl
        self._idle = 0.0
        self._seen_event = False
        self.deadline = min(total_dl, first_dl)

    def fed(self, now: float, raw: Sequence[object], events: Sequence[Event]) -> None:
        """Feeding (a slice of) the read at ``now`` completed ``raw`` provider events and made ``events``."""
        if raw and not self._seen_event:
            self._seen_event = True  # the first provider event: the idle timer takes over from first_byte
            self._idle = now + self._timeouts.idle
        if events:
            self._idle = now + self._timeouts.idle  # only a content event proves progress
        self.deadline = min(self._total, self._idle if self._seen_event else self._first)

    def fired(self, now: float) -> tuple[str, float]:
        """The timer that fired at ``now``: its name and its seconds."""
        if now >= self._total:
            return "total", self._timeouts.total
        if self._seen_event:
            return "idle", self._timeouts.idle
        return "first_byte", self._timeouts.first_byte


class _ReadWindow:
    """Telemetry's figures of the body's reads, kept here so that a read costs the same with telemetry on or
    off (on the paced path a call into the attempt's telemetry per read cost more than normalizing the
    event): the body's bytes so far, the window's longest gap between reads that made events (-1: none
    yet), when the last such read returned, and whether the attempt's firsts are still to be looked for.
    The attempt hears of them a few times per attempt (``firsts``) and once per window: at the first read
    at or past the window's end, before that read is fed (the window holds the read's bytes, its events go
    to the next), and when the body ends."""

    __slots__ = ("_counts", "_end", "_events_at", "_gap", "_received", "_tel", "firsts")

    def __init__(self, tel: AttemptTelemetry, counts: Callable[[], Mapping[str, int]]) -> None:
        self._tel, self._counts = tel, counts  # counts: the normalizer's running totals
        self._received = 0
        self._gap = -1.0
        self._events_at = -1.0
        self._end = tel.window_end
        self.firsts = True

    def read(self, now: float, n: int) -> None:
        """A read at ``now`` brought ``n`` bytes."""
        self._received += n
        if now >= self._end:
            self._end = self._tel.window(now, self._received, self._gap, self._counts)
            self._gap = -1.0
        if self.firsts and self._received == n:  # the body's first bytes (the first-byte time)
            self.firsts = self._tel.firsts(now, 0, ())

    def made_events(self, now: float) -> None:
        """The read at ``now`` made contract events (called once per read): its gap since the last such."""
        if self._events_at >= 0 and now - self._events_at > self._gap:
            self._gap = now - self._events_at
        self._events_at = now

    def fed(self, now: float, n_raw: int, events: Sequence[Event]) -> None:
        """Feeding (a slice of) the read at ``now`` completed ``n_raw`` provider events and made ``events``;
        call only while ``firsts``."""
        self.firsts = self._tel.firsts(now, n_raw, events)

    def close(self, now: float) -> None:
        """The body ended, at ``now`` or by an exception: the last window."""
        self._tel.window(now, self._received, self._gap, self._counts)


async def _feed_held(
    norm: Normalizer,
    redacting: RedactingStream,
    emit: Callable[[PendingBatch], Awaitable[None]],
    window: _ReadWindow,
    now: float,
) -> None:
    """At the body's end: feed and store the bytes the redaction held back in case they began a secret
    (they did not)."""
    if not (held := redacting.flush()):
        return
    ts = now_ms()
    raw, events = norm.feed(held, ts)
    if window.firsts and (raw or events):
        window.fed(now, len(raw), events)
    batch = PendingBatch.normalized(raw, events, ts)
    if len(batch):
        await emit(batch)
    if events:
        window.made_events(now)


def _broken(norm: Normalizer, exc: HTTPError) -> PendingBatch:
    """The terminal of a connection that broke mid-body, and the unfinished event it cut off."""
    batch = PendingBatch.of(_transport_failure(norm, exc, responded=True))
    _add_tail(batch, norm, ended=False)
    return batch


def _ended(norm: Normalizer) -> PendingBatch:
    """What the body's end makes: the normalizer's close (the terminal, when the stream gave none), and
    the unfinished event the end cut off."""
    ts = now_ms()
    batch = PendingBatch.normalized(*norm.close_batch(ts), ts)
    _add_tail(batch, norm, ended=True)
    return batch


def _transport_failure(norm: Normalizer, exc: HTTPError, *, responded: bool) -> list[Event]:
    """The terminal an HTTP-layer failure makes: category ``transport`` for every kind (the stream's own
    timers are ``timeout``), retryable only before a response (nothing was visible yet); the message says
    how far the request got, then the failure (``str(exc)``: its kind and sluice's detail)."""
    if responded:
        return norm.interrupt("transport", f"the connection broke mid-stream ({exc})", now_ms())
    if isinstance(exc, NOT_SENT):
        return norm.interrupt("transport", f"could not connect to the provider ({exc})", now_ms(), retryable=True)
    msg = f"the connection failed before a response ({exc})"
    return norm.interrupt("transport", msg, now_ms(), retryable=True)


def _add_tail(batch: PendingBatch, norm: Normalizer, *, ended: bool) -> None:
    """The unfinished event the transport's end cut off, kept byte for byte in the raw log."""
    decoder = norm.decoder
    if not ended:
        decoder.close()  # the connection broke: what was buffered will never be completed
    if decoder.dropped_tail:
        batch.add_tail(decoder.dispatched + 1, decoder.dropped_tail, decoder.dropped_at, now_ms())


async def _read_bounded(response: UpstreamResponse, limit: int, deadline: float) -> bytes:
    buf = bytearray()
    try:
        while len(buf) < limit:
            chunk = await response.receive(deadline)
            if not chunk:
                break
            buf += chunk
    except HTTPError:
        pass  # the error body is kept as far as it came: the status is the failure
    return bytes(buf[:limit])

"""One attempt's whole pipeline, sans-IO: bytes -> raw events -> adapter actions -> contract events.

Rule: the caller feeds bytes with a timestamp and gets back the raw events (for the raw log) and the
contract events (for the normalized log), in order. The framing is the dialect's (``Adapter.FRAMING``):
``text/event-stream`` (``SSEDecoder``) or AWS event-stream (``EventStreamDecoder``, Bedrock), both giving
``SSEEvent`` records. Every fault (malformed SSE, a broken event-stream frame, invalid JSON (the one
mapping of an adapter's ``msgspec.DecodeError``), invalid UTF-8, a passed limit, a provider error, EOF)
becomes exactly one terminal event; what was received before it is never dropped. After the terminal, bytes
are still framed for the raw log but no longer normalized. Secrets leave at the place the framing allows
(``redact_with``; ``sluice.normalizer.redact``'s rule), never changing the framing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import msgspec

from sluice.normalizer.actions import Action, Warn
from sluice.normalizer.adapters import get_adapter
from sluice.normalizer.eventstream import EventStreamDecoder, EventStreamLimitExceeded, EventStreamProtocolError
from sluice.normalizer.limits import Limits
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.normalizer.redact import RedactingStream, Redactor
from sluice.normalizer.sse import SSEDecoder, SSEEvent, SSELimitExceeded
from sluice.schemas.errors import LimitExceeded, ProviderProtocolError
from sluice.schemas.events import Event
from sluice.schemas.result import Result

__all__ = ["NORMALIZER_VERSION", "Batch", "Normalizer", "normalize_bytes"]

# Recorded with every request (the status's normalizer_version); `sluice audit` prints it beside the version
# it replays with, so a mismatch found after an upgrade is read as such.
NORMALIZER_VERSION = "sluice-normalizer/1"


_NO_SECRETS = Redactor(())


class Batch(NamedTuple):
    raw: list[SSEEvent]
    events: list[Event]


class Normalizer:
    def __init__(self, dialect: str, info: StreamInfo, limits: Limits | None = None) -> None:
        """Raises ``UnknownDialect``."""
        self.limits = limits or Limits()
        self.adapter = get_adapter(dialect)
        self.info = StreamInfo(
            stream_id=info.stream_id,
            request_id=info.request_id,
            provider=info.provider or self.adapter.provider,
            dialect=self.adapter.dialect,
            attempt=info.attempt,
            model=info.model,
            route=info.route,
            checks=info.checks,
        )
        self.decoder: SSEDecoder | EventStreamDecoder
        if self.adapter.FRAMING == "eventstream":
            # A whole message is one event: the event bound caps it.
            self.decoder = EventStreamDecoder(max_frame_bytes=self.limits.max_event_bytes)
        else:
            self.decoder = SSEDecoder(
                max_line_bytes=self.limits.max_line_bytes,
                max_event_bytes=self.limits.max_event_bytes,
                unframed_json=self.adapter.UNFRAMED_JSON,
            )
        self.machine = StreamMachine(self.info, max_tool_argument_bytes=self.limits.max_tool_argument_bytes)
        self.bytes_in = 0
        self.after_terminal = 0  # raw events that arrived after the terminal event

    @property
    def terminal(self) -> bool:
        return self.machine.terminal

    def redact_with(self, secrets: Redactor) -> RedactingStream:
        """Remove ``secrets`` where this dialect's framing allows; returns the stream the body's bytes pass
        before ``feed``: ``secrets.stream()`` for ``text/event-stream``, where redacting the bytes is
        redacting the values; a pass-through for AWS event-stream, whose decoder redacts each message once
        it is decoded."""
        if isinstance(self.decoder, EventStreamDecoder):
            self.decoder.redact_with(secrets)
            return _NO_SECRETS.stream()
        return secrets.stream()

    def feed(self, chunk: bytes, ts: int) -> Batch:
        self.bytes_in += len(chunk)
        events: list[Event] = []
        try:
            raw = self.decoder.feed(chunk)
        except (SSELimitExceeded, EventStreamLimitExceeded) as exc:
            raw = exc.events
            self._process_all(raw, ts, events)
            self._fail_limit(exc, ts, events, [e.index for e in raw[-1:]])
            return Batch(raw, events)
        except EventStreamProtocolError as exc:
            # The broken bytes are a raw event of their own, so the raw log (and an audit) holds them.
            raw = exc.events
            self._process_all(raw, ts, events)
            if exc.broken is not None:
                raw = [*raw, exc.broken]
            if not self.machine.terminal:
                refs = [exc.broken.index] if exc.broken is not None else []
                events += self.machine.fail("protocol", exc.message, ts=ts, raw=refs)
            return Batch(raw, events)
        self._process_all(raw, ts, events)
        if not self.machine.terminal and self.bytes_in > self.limits.max_total_bytes:
            self._fail_limit(LimitExceeded("response body", self.limits.max_total_bytes), ts, events, [])
        return Batch(raw, events)

    def close(self, ts: int) -> list[Event]:
        """The transport ended (EOF). Without the dialect's terminal signal this is ``interrupted``.
        (``close_batch`` also returns a raw event the end of input completed, for the raw log.)"""
        return self.close_batch(ts).events

    def close_batch(self, ts: int) -> Batch:
        """``close``, with the raw events the end of input completed: an unframed JSON body whose last
        line had no line end (Gemini's error tail) is one, and belongs in the raw log like any other."""
        raw, dropped = self.decoder.close_events()
        events: list[Event] = []
        self._process_all(raw, ts, events)
        if self.machine.terminal:
            return Batch(raw, events)
        # What the adapter concludes at EOF (Gemini's finish) points at the last raw event it saw.
        self._apply(self.adapter.end(), ts, [self.decoder.dispatched] if self.decoder.dispatched else [], events)
        if not self.machine.terminal:
            detail = f" ({dropped} bytes of an unfinished event dropped)" if dropped else ""
            events += self.machine.interrupt(
                "transport", f"the stream ended before the provider's terminal signal{detail}", ts=ts
            )
        return Batch(raw, events)

    def interrupt(self, category: str, message: str, ts: int, *, retryable: bool | None = None) -> list[Event]:
        """A timer fired, the request was cancelled, the connection failed, or the worker was lost."""
        if self.machine.terminal:
            return []
        return self.machine.interrupt(category, message, ts=ts, retryable=retryable)

    def fail(
        self,
        category: str,
        message: str,
        ts: int,
        *,
        provider_code: str | None = None,
        retryable: bool | None = None,
    ) -> list[Event]:
        """The request failed outside the stream (e.g. an HTTP error status before any event)."""
        if self.machine.terminal:
            return []
        return self.machine.fail(category, message, ts=ts, provider_code=provider_code, retryable=retryable)

    def result(self) -> Result:
        return self.machine.result()

    def counts(self) -> dict[str, int]:
        """The two running totals of ``statistics`` the worker's telemetry reads every few seconds (provider
        events, contract events), without building the rest."""
        return {"sse_events": self.decoder.dispatched, "events": self.machine.seq}

    def statistics(self) -> dict[str, int]:
        # Prefixed so the decoder's and the machine's counters (both have "events") never shadow each other.
        return {
            **{f"sse_{k}": v for k, v in self.decoder.statistics().items()},
            **self.machine.statistics(),
            "after_terminal": self.after_terminal,
        }

    # -- internals --------------------------------------------------------------------------------

    def _process_all(self, raw: list[SSEEvent], ts: int, events: list[Event]) -> None:
        machine, feed, limits = self.machine, self.adapter.feed, self.limits
        for sse in raw:
            if machine.terminal:
                self.after_terminal += 1
                continue
            if sse.index > limits.max_raw_events:
                self._fail_limit(LimitExceeded("raw events", limits.max_raw_events), ts, events, [sse.index])
                continue
            refs = [sse.index]
            if sse.invalid_utf8 and limits.invalid_utf8 == "fail":
                events += machine.fail(
                    "protocol",
                    f"raw event {sse.index} (byte {sse.offset}) is not valid UTF-8",
                    ts=ts,
                    raw=refs,
                )
                continue
            try:
                actions = feed(sse)
            except ProviderProtocolError as exc:
                events += machine.fail("protocol", exc.message, ts=ts, raw=refs, block_index=exc.block_index)
                continue
            except msgspec.DecodeError as exc:  # an adapter's view struct did not fit: one message for every dialect
                msg = f"raw event {sse.index} (byte {sse.offset}): data is not valid JSON for this dialect ({exc})"
                events += machine.fail("protocol", msg, ts=ts, raw=refs, block_index=None)
                continue
            if len(actions) == 1:  # nearly every provider event: its one action, without ``_apply``'s loop
                self._process(actions[0], ts, refs, events)
            else:
                self._apply(actions, ts, refs, events)
            if sse.invalid_utf8 and not machine.terminal and machine.seq:
                events += machine.process(
                    Warn("invalid_utf8", f"raw event {sse.index} had invalid UTF-8, replaced by U+FFFD"),
                    ts=ts,
                    raw=refs,
                )

    def _apply(self, actions: Iterable[Action], ts: int, refs: list[int], events: list[Event]) -> None:
        for action in actions:
            if self.machine.terminal:
                return
            self._process(action, ts, refs, events)

    def _process(self, action: Action, ts: int, refs: list[int], events: list[Event]) -> None:
        """One action into the machine; a protocol error or a limit it raises ends the stream."""
        try:
            events += self.machine.process(action, ts=ts, raw=refs)
        except ProviderProtocolError as exc:
            events += self.machine.fail("protocol", exc.message, ts=ts, raw=refs, block_index=exc.block_index)
        except LimitExceeded as exc:
            self._fail_limit(exc, ts, events, refs)

    def _fail_limit(self, exc: LimitExceeded, ts: int, events: list[Event], refs: list[int]) -> None:
        if not self.machine.terminal:
            events += self.machine.fail("limit_exceeded", exc.message, ts=ts, raw=refs, block_index=exc.block_index)


def normalize_bytes(
    chunks: Iterable[bytes], dialect: str, info: StreamInfo, *, ts: int = 0, limits: Limits | None = None
) -> tuple[list[SSEEvent], list[Event], Result]:
    """Normalize a whole recorded body; the end of ``chunks`` is the end of the transport."""
    n = Normalizer(dialect, info, limits)
    raw: list[SSEEvent] = []
    events: list[Event] = []
    for chunk in chunks:
        batch = n.feed(chunk, ts)
        raw += batch.raw
        events += batch.events
    last = n.close_batch(ts)
    return raw + last.raw, events + last.events, n.result()

"""AWS Bedrock ConverseStream (``POST /model/{model}/converse-stream``, AWS event-stream framing) to contract actions.

Rule: each event-stream message arrives with its ``:message-type`` in ``id`` and its ``:event-type`` (or
``:exception-type`` / ``:error-code``) in ``event``. Blocks are keyed by ``contentBlockIndex``: a tool call
opens at its ``contentBlockStart`` (``toolUse``: id and name); text and reasoning blocks have no start
event and open at their first delta, with the kind of that delta (``reasoningContent.redactedContent``
first: an ``encrypted`` reasoning block whose signature is the opaque data); a delta of another kind in
the same block is a protocol error. ``messageStop`` carries the stop reason and ``metadata`` (usage)
follows it: the completion proof is ``metadata`` after ``messageStop`` (the last event of every
ConverseStream response, as the API reference lists it), so EOF before it, even after ``messageStop``,
is ``interrupted`` (as openai-chat's ``[DONE]``). An ``exception`` message (``throttlingException``,
``validationException``, ...) or an unmodeled ``error`` message fails the stream with the category of its
type; unknown events are skipped unread (the header names them, so any payload passes), and unknown delta
kinds (``citation``, ``image``) are counted and skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, SetUsage, Start
from sluice.normalizer.adapters.base import Adapter, safe_message
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.errors import ProviderProtocolError
from sluice.schemas.events import BlockKind, ErrorCategory, StopReason, Usage

__all__ = ["BedrockConverseAdapter"]


class _ToolUseStart(msgspec.Struct):
    toolUseId: str | None = None
    name: str | None = None


class _Start(msgspec.Struct):
    toolUse: _ToolUseStart | None = None


class _ToolUseDelta(msgspec.Struct):
    input: str = ""


class _Reasoning(msgspec.Struct):
    text: str | None = None
    signature: str | None = None
    redactedContent: str | None = None


class _Delta(msgspec.Struct):
    text: str | None = None
    toolUse: _ToolUseDelta | None = None
    reasoningContent: _Reasoning | None = None


class _Usage(msgspec.Struct):
    inputTokens: int | None = None
    outputTokens: int | None = None
    totalTokens: int | None = None
    cacheReadInputTokens: int | None = None
    cacheWriteInputTokens: int | None = None


# One view per event type, of only the fields sluice reads from it (the house rule for provider payloads):
# a smaller struct decodes faster, and the event's name (a header) already says which one applies.
class _DeltaEvent(msgspec.Struct):
    contentBlockIndex: int | None = None
    delta: _Delta | None = None


class _StartEvent(msgspec.Struct):
    contentBlockIndex: int | None = None
    start: _Start | None = None


class _StopEvent(msgspec.Struct):
    contentBlockIndex: int | None = None


class _MessageStart(msgspec.Struct):
    role: str | None = None


class _MessageStop(msgspec.Struct):
    stopReason: str | None = None


class _Metadata(msgspec.Struct):
    usage: _Usage | None = None


class _Exception(msgspec.Struct):
    message: str | None = None
    originalStatusCode: int | None = None
    originalMessage: str | None = None


_DELTA = msgspec.json.Decoder(_DeltaEvent)
_VIEWS: dict[str, msgspec.json.Decoder[Any]] = {
    "contentBlockStart": msgspec.json.Decoder(_StartEvent),
    "contentBlockStop": msgspec.json.Decoder(_StopEvent),
    "messageStart": msgspec.json.Decoder(_MessageStart),
    "messageStop": msgspec.json.Decoder(_MessageStop),
    "metadata": msgspec.json.Decoder(_Metadata),
}
_EXCEPTION = msgspec.json.Decoder(_Exception)
# A message without a payload reads as a payload without fields: each view's empty instance.
_EMPTY: dict[str, Any] = {name: dec.type() for name, dec in {**_VIEWS, "contentBlockDelta": _DELTA}.items()}


def _usage(u: _Usage) -> Usage:
    return Usage(
        input_tokens=u.inputTokens,
        output_tokens=u.outputTokens,
        total_tokens=u.totalTokens,
        cache_read_tokens=u.cacheReadInputTokens,
        cache_write_tokens=u.cacheWriteInputTokens,
    )


class BedrockConverseAdapter(Adapter):
    dialect = "bedrock-converse"
    provider = "bedrock"
    FRAMING: ClassVar[Literal["sse", "eventstream"]] = "eventstream"
    STOP_REASONS: ClassVar[dict[str, StopReason]] = {
        "end_turn": "stop",
        "stop_sequence": "stop",
        "tool_use": "tool_use",
        "max_tokens": "length",
        "model_context_window_exceeded": "length",
        "guardrail_intervened": "content_filter",
        "content_filtered": "content_filter",
    }
    # The exception's type (``:exception-type``; an unmodeled error's ``:error-code`` with its first letter
    # lowered) -> category.
    ERROR_CATEGORIES: ClassVar[dict[str, ErrorCategory]] = {
        "throttlingException": "rate_limit",
        "serviceQuotaExceededException": "rate_limit",
        "serviceUnavailableException": "overloaded",
        "modelNotReadyException": "overloaded",
        "internalServerException": "server_error",
        "modelStreamErrorException": "server_error",
        "modelTimeoutException": "server_error",
        "validationException": "invalid_request",
        "modelErrorException": "invalid_request",
        "accessDeniedException": "permission",
        "unrecognizedClientException": "authentication",
        "expiredTokenException": "authentication",
        "resourceNotFoundException": "not_found",
        # unmodeled errors (``:message-type error``) name AWS's generic codes
        "internalFailure": "server_error",
        "serviceUnavailable": "overloaded",
    }
    TERMINAL_SIGNALS: ClassVar[dict[str, str]] = {
        "metadata after messageStop": "completed (stop reason from messageStop, usage from metadata)",
        ":message-type exception": "failed (category from :exception-type)",
        ":message-type error": "failed (category from :error-code)",
        "a frame whose CRC or lengths do not hold": "failed / protocol",
        "EOF before metadata (also after messageStop)": "interrupted / transport",
    }

    def __init__(self) -> None:
        self._kinds: dict[int, BlockKind] = {}  # open blocks by contentBlockIndex
        self._stop: str | None = None
        self._stopped = False

    def feed(self, sse: SSEEvent) -> list[Action]:
        kind, name = sse.id, sse.event
        if name == "contentBlockDelta" and kind == "event":  # nearly every message: first, and text the short way
            ev = _DELTA.decode(sse.data) if sse.data else _EMPTY[name]  # JSON that does not fit: the protocol error
            d, idx = ev.delta, ev.contentBlockIndex
            if d is not None and d.text is not None and idx is not None and self._kinds.get(idx) == "text":
                return [Append(idx, "text", d.text)]
            return self._delta(ev)
        if kind == "exception":
            return [self._exception(name, _EXCEPTION.decode(sse.data) if sse.data else _Exception())]
        if kind == "error":
            headers = sse.headers or {}
            code = name[:1].lower() + name[1:]
            message = headers.get(":error-message")
            return [
                Fail(
                    category=self.error_category(code),
                    provider_code=name or None,
                    message=safe_message(message, "the provider reported an error"),
                )
            ]
        if kind != "event":
            return [Ignore(f"message-type:{kind or '?'}")]
        view = _VIEWS.get(name)
        if view is None:
            # The header names the event, so an unknown one is skipped unread, whatever its payload (JSON,
            # CSV, XML): the frame's CRCs already proved the framing (docs/contract.md, unknown events).
            return [Ignore(name or "untyped event")]
        ev = view.decode(sse.data) if sse.data else _EMPTY[name]
        if isinstance(ev, _StartEvent):
            return self._block_start(ev)
        if isinstance(ev, _StopEvent):
            idx = self._index(ev.contentBlockIndex, name)
            if self._kinds.pop(idx, None) is None:
                # A block whose deltas were all skipped (or empty) never opened: nothing to close.
                return [Ignore("contentBlockStop", unknown=False)]
            return [Close(idx)]
        if isinstance(ev, _MessageStart):
            return [Start()]
        if isinstance(ev, _MessageStop):
            self._stop, self._stopped = ev.stopReason, True
            return [Ignore("messageStop", unknown=False)]
        assert isinstance(ev, _Metadata)
        usage = _usage(ev.usage) if ev.usage is not None else None
        if not self._stopped:
            return [SetUsage(usage)] if usage is not None else [Ignore("metadata", unknown=False)]
        return [Finish(stop_reason=self.stop_reason(self._stop), provider_stop_reason=self._stop, usage=usage)]

    @staticmethod
    def _index(idx: int | None, name: str) -> int:
        if idx is None:
            raise ProviderProtocolError(f"{name} without a contentBlockIndex")
        return idx

    def _exception(self, code: str, ev: _Exception) -> Fail:
        message = ev.message or ev.originalMessage
        if ev.originalStatusCode is not None:
            message = f"{message or 'the model failed'} (model status {ev.originalStatusCode})"
        return Fail(
            category=self.error_category(code),
            provider_code=code or None,
            message=safe_message(message, "the provider reported an exception"),
        )

    def _block_start(self, ev: _StartEvent) -> list[Action]:
        idx = self._index(ev.contentBlockIndex, "contentBlockStart")
        tool = ev.start.toolUse if ev.start is not None else None
        if tool is None:
            return [Ignore("contentBlockStart:?")]
        self._kinds[idx] = "tool_call"
        return [Open(idx, "tool_call", name=tool.name, call_id=tool.toolUseId)]

    def _delta(self, ev: _DeltaEvent) -> list[Action]:
        idx = self._index(ev.contentBlockIndex, "contentBlockDelta")
        d = ev.delta
        if d is None:
            return [Ignore("delta:?")]
        if d.text is not None:
            return self._append(idx, "text", "text", d.text)
        if d.toolUse is not None:
            if self._kinds.get(idx) != "tool_call":
                raise ProviderProtocolError(f"toolUse delta for block {idx}, which no toolUse start opened")
            return [Append(idx, "json_text", d.toolUse.input)]
        r = d.reasoningContent
        if r is not None:
            if r.text is not None:
                return self._append(idx, "reasoning", "text", r.text)
            if r.signature is not None:
                return self._append(idx, "reasoning", "signature", r.signature)
            if r.redactedContent is not None:
                return self._append(idx, "reasoning", "signature", r.redactedContent, encrypted=True)
            return [Ignore("delta:reasoningContent:?")]
        return [Ignore("delta:?")]

    def _append(
        self, idx: int, kind: BlockKind, delta: Literal["text", "signature"], text: str, *, encrypted: bool = False
    ) -> list[Action]:
        have = self._kinds.get(idx)
        if have is None:
            self._kinds[idx] = kind
            return [Open(idx, kind, encrypted=encrypted), Append(idx, delta, text)]
        if have != kind:
            raise ProviderProtocolError(f"a {kind} delta in block {idx}, which is a {have} block")
        return [Append(idx, delta, text)]

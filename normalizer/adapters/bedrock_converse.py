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
type; unknown events and delta kinds (``citation``, ``image``) are counted and skipped.
"""

from __future__ import annotations

from typing import ClassVar, Literal

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


class _Payload(msgspec.Struct):
    """Every Converse event's fields in one view (each event uses a few); unknown fields are skipped."""

    role: str | None = None
    contentBlockIndex: int | None = None
    start: _Start | None = None
    delta: _Delta | None = None
    stopReason: str | None = None
    usage: _Usage | None = None
    message: str | None = None  # exceptions
    originalStatusCode: int | None = None
    originalMessage: str | None = None


_DECODER = msgspec.json.Decoder(_Payload)
_EMPTY = _Payload()


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
        kind = sse.id
        if kind == "exception":
            return [self._exception(sse.event, _DECODER.decode(sse.data) if sse.data else _EMPTY)]
        if kind == "error":
            headers = sse.headers or {}
            code = sse.event[:1].lower() + sse.event[1:]
            message = headers.get(":error-message")
            return [
                Fail(
                    category=self.error_category(code),
                    provider_code=sse.event or None,
                    message=safe_message(message, "the provider reported an error"),
                )
            ]
        if kind != "event":
            return [Ignore(f"message-type:{kind or '?'}")]
        name = sse.event
        ev = _DECODER.decode(sse.data) if sse.data else _EMPTY  # JSON that does not fit: the protocol error
        if name == "contentBlockDelta":
            return self._delta(ev)
        if name == "contentBlockStart":
            return self._block_start(ev)
        if name == "contentBlockStop":
            idx = self._index(ev, name)
            if self._kinds.pop(idx, None) is None:
                # A block whose deltas were all skipped (or empty) never opened: nothing to close.
                return [Ignore("contentBlockStop", unknown=False)]
            return [Close(idx)]
        if name == "messageStart":
            return [Start()]
        if name == "messageStop":
            self._stop, self._stopped = ev.stopReason, True
            return [Ignore("messageStop", unknown=False)]
        if name == "metadata":
            usage = _usage(ev.usage) if ev.usage is not None else None
            if not self._stopped:
                return [SetUsage(usage)] if usage is not None else [Ignore("metadata", unknown=False)]
            return [Finish(stop_reason=self.stop_reason(self._stop), provider_stop_reason=self._stop, usage=usage)]
        return [Ignore(name or "untyped event")]

    @staticmethod
    def _index(ev: _Payload, name: str) -> int:
        if ev.contentBlockIndex is None:
            raise ProviderProtocolError(f"{name} without a contentBlockIndex")
        return ev.contentBlockIndex

    def _exception(self, code: str, ev: _Payload) -> Fail:
        message = ev.message or ev.originalMessage
        if ev.originalStatusCode is not None:
            message = f"{message or 'the model failed'} (model status {ev.originalStatusCode})"
        return Fail(
            category=self.error_category(code),
            provider_code=code or None,
            message=safe_message(message, "the provider reported an exception"),
        )

    def _block_start(self, ev: _Payload) -> list[Action]:
        idx = self._index(ev, "contentBlockStart")
        tool = ev.start.toolUse if ev.start is not None else None
        if tool is None:
            return [Ignore("contentBlockStart:?")]
        self._kinds[idx] = "tool_call"
        return [Open(idx, "tool_call", name=tool.name, call_id=tool.toolUseId)]

    def _delta(self, ev: _Payload) -> list[Action]:
        idx = self._index(ev, "contentBlockDelta")
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

"""Anthropic Messages streaming (``POST /v1/messages``, ``stream: true``) to contract actions.

Rule: blocks follow Anthropic's own content-block lifecycle (start, deltas, stop, keyed by the
provider's ``index``), except that a text or thinking block starts at its first non-empty content (the
machine's rule for every dialect: Anthropic frames an empty text block before a refusal, which opens
nothing); ``redacted_thinking`` is an ``encrypted`` reasoning block whose signature is its data.
``message_stop`` is the only success terminal: with ``max_tokens`` a tool call closed with cut JSON stops
with ``arguments_error: "truncated"`` and the stream completes with ``length`` (the machine decides);
``event: error`` fails the stream; ``ping``, ``citations_delta`` and unknown events or block types are
counted and skipped. Usage from ``message_start`` and the cumulative ``message_delta`` counts is merged,
never summed, and reaches ``stream.error`` too, with a ``usage`` a proxy puts beside an error.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, SetUsage, Start
from sluice.normalizer.adapters.base import Adapter, safe_message
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.errors import ProviderProtocolError
from sluice.schemas.events import BlockKind, DeltaKind, ErrorCategory, StopReason, Usage

__all__ = ["AnthropicAdapter"]


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class _Message(msgspec.Struct):
    id: str | None = None
    model: str | None = None
    usage: _Usage | None = None


class _ContentBlock(msgspec.Struct):
    type: str = ""
    id: str | None = None
    name: str | None = None
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    input: Any = None


class _Delta(msgspec.Struct):
    type: str | None = None
    text: str | None = None
    partial_json: str | None = None
    thinking: str | None = None
    signature: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None


class _Error(msgspec.Struct):
    type: str | None = None
    message: str | None = None


class _Event(msgspec.Struct):
    type: str = ""
    index: int | None = None
    message: _Message | None = None
    content_block: _ContentBlock | None = None
    delta: _Delta | None = None
    usage: _Usage | None = None
    error: _Error | None = None


_DECODER = msgspec.json.Decoder(_Event)
_ARGS_ENCODER = msgspec.json.Encoder()

# content_block_start types that become contract blocks; server-side tools (server_tool_use and the
# *_tool_result blocks) are executed by Anthropic and must never look like a call to execute.
_BLOCK_KINDS: dict[str | None, BlockKind] = {
    "text": "text",
    "thinking": "reasoning",
    "redacted_thinking": "reasoning",
    "tool_use": "tool_call",
}
_DELTAS: dict[str, tuple[DeltaKind, str]] = {
    "text_delta": ("text", "text"),
    "thinking_delta": ("text", "thinking"),
    "input_json_delta": ("json_text", "partial_json"),
    "signature_delta": ("signature", "signature"),
}


def _usage(u: _Usage) -> Usage:
    return Usage(
        input_tokens=u.input_tokens,
        output_tokens=u.output_tokens,
        cache_read_tokens=u.cache_read_input_tokens,
        cache_write_tokens=u.cache_creation_input_tokens,
    )


class AnthropicAdapter(Adapter):
    dialect = "anthropic"
    provider = "anthropic"
    STOP_REASONS: ClassVar[dict[str, StopReason]] = {
        "end_turn": "stop",
        "stop_sequence": "stop",
        "tool_use": "tool_use",
        "max_tokens": "length",
        "model_context_window_exceeded": "length",
        "refusal": "refusal",
        "pause_turn": "pause_turn",
    }
    ERROR_CATEGORIES: ClassVar[dict[str, ErrorCategory]] = {
        "overloaded_error": "overloaded",
        "rate_limit_error": "rate_limit",
        "api_error": "server_error",
        "timeout_error": "server_error",
        "invalid_request_error": "invalid_request",
        "request_too_large": "invalid_request",
        "authentication_error": "authentication",
        "permission_error": "permission",
        "not_found_error": "not_found",
        "billing_error": "billing",
    }
    TERMINAL_SIGNALS: ClassVar[dict[str, str]] = {
        "message_stop": "completed (stop reason from the preceding message_delta; with max_tokens a tool call "
        "closed with cut JSON stops with arguments_error truncated)",
        "event: error": "failed (category from error.type)",
        "EOF before message_stop": "interrupted / transport",
    }

    def __init__(self) -> None:
        self._stop_reason: str | None = None
        self._skipped: set[int] = set()  # provider indices of blocks sluice does not translate

    def feed(self, sse: SSEEvent) -> list[Action]:
        ev = _DECODER.decode(sse.data)  # JSON that does not fit: the Normalizer's protocol error
        kind = ev.type or sse.event
        if kind == "message_start":
            msg = ev.message or _Message()
            out: list[Action] = [Start(model=msg.model, response_id=msg.id)]
            if msg.usage is not None:
                out.append(SetUsage(_usage(msg.usage)))
            return out
        if kind == "content_block_start":
            return self._block_start(ev)
        if kind == "content_block_delta":
            return self._block_delta(ev)
        if kind == "content_block_stop":
            if ev.index in self._skipped:
                return [Ignore("content_block_stop", unknown=False)]
            return [Close(ev.index)]
        if kind == "message_delta":
            out = []
            if ev.delta is not None and ev.delta.stop_reason is not None:
                self._stop_reason = ev.delta.stop_reason
            if ev.usage is not None:
                out.append(SetUsage(_usage(ev.usage)))
            return out or [Ignore("message_delta", unknown=False)]
        if kind == "message_stop":
            return [Finish(stop_reason=self.stop_reason(self._stop_reason), provider_stop_reason=self._stop_reason)]
        if kind == "error":
            err = ev.error or _Error()
            return [
                Fail(
                    category=self.error_category(err.type),
                    provider_code=err.type,
                    message=safe_message(err.message, "the provider reported an error"),
                    # Anthropic's own error event has none (message_start / message_delta already
                    # reported it); a proxy may put the usage billed beside the error.
                    usage=_usage(ev.usage) if ev.usage is not None else None,
                )
            ]
        if kind == "ping":
            return [Ignore("ping", unknown=False)]
        return [Ignore(kind or "untyped event")]

    def _block_start(self, ev: _Event) -> list[Action]:
        cb = ev.content_block or _ContentBlock()
        if ev.index is None:
            # Every later delta and stop names the block by this index: without it nothing can follow.
            raise ProviderProtocolError(f"content_block_start ({cb.type or '?'}) without an index")
        kind = _BLOCK_KINDS.get(cb.type)
        if kind is None:
            self._skipped.add(ev.index)
            return [Ignore(f"content_block:{cb.type or '?'}")]
        out: list[Action] = [
            Open(ev.index, kind, name=cb.name, call_id=cb.id, encrypted=cb.type == "redacted_thinking")
        ]
        if cb.type == "text" and cb.text:
            out.append(Append(ev.index, "text", cb.text))
        elif cb.type == "thinking" and cb.thinking:
            out.append(Append(ev.index, "text", cb.thinking))
        elif cb.type == "redacted_thinking" and cb.data:
            # Opaque encrypted reasoning: no text, only a token to pass back unchanged.
            out.append(Append(ev.index, "signature", cb.data))
        elif cb.type == "tool_use" and isinstance(cb.input, dict) and cb.input:
            # ``input: {}`` is a placeholder; a proxy that sends the whole input up front is honoured.
            out.append(Append(ev.index, "json_text", _ARGS_ENCODER.encode(cb.input).decode()))
        return out

    def _block_delta(self, ev: _Event) -> list[Action]:
        d = ev.delta or _Delta()
        if ev.index in self._skipped:
            return [Ignore(f"delta:{d.type}", unknown=False)]
        spec = _DELTAS.get(d.type or "")
        if spec is None:
            return [Ignore(d.type or "untyped delta")]
        delta_kind, attr = spec
        return [Append(ev.index, delta_kind, getattr(d, attr) or "")]

"""Gemini ``models/{model}:streamGenerateContent?alt=sse`` to contract actions.

Rule: every SSE event is one whole ``GenerateContentResponse``; only ``candidates[0]`` (the candidate
with ``index`` 0) is normalized. Consecutive text parts continue one text block and consecutive
``thought: true`` parts one reasoning block; a switch closes the previous block. A ``functionCall``
part arrives whole and becomes a closed tool_call block at once. A ``thoughtSignature`` goes into the
block of the part that carried it; a signature-only part (empty text) never opens a block. Gemini has no
end marker: ``finishReason`` (or ``promptFeedback.blockReason``) is remembered, the last one seen wins,
and the stream finishes only at EOF (``end``); EOF without either is interrupted. A ``{"error": ...}``
object fails the stream at once, framed as an event or appended without SSE framing (the unframed error
tail some tiers send before closing; the decoder collects it with ``unframed_json``). Its category comes
from ``error.status``, unless a ``google.rpc.ErrorInfo`` reason says more (``ERROR_REASONS``); a
``usageMetadata`` beside the error (a gateway's) goes with the failure into ``stream.error``, and a
chunk's usage is taken before its parts, so a part that fails the stream does not lose it. Function
calls arrive whole, so a call is never cut: ``MAX_TOKENS`` completes with ``length`` and whole calls.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, SetUsage, Start, Warn
from sluice.normalizer.adapters.base import Adapter, as_str, safe_message
from sluice.normalizer.http_errors import ERROR_INFO_REASONS, error_info_reason
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.events import BlockKind, ErrorCategory, StopReason, Usage

__all__ = ["GeminiAdapter"]


class _View(msgspec.Struct, rename="camel"):
    """Provider views: only the fields read, camelCase on the wire, unknown fields accepted."""


class _FunctionCall(_View):
    name: str | None = None
    args: Any = None
    id: str | None = None


class _Part(_View):
    text: str | None = None
    thought: bool = False
    thought_signature: str | None = None
    function_call: _FunctionCall | None = None
    # Documented part kinds sluice does not translate; read (as raw bytes, never parsed) only to name
    # them in the skip count. An empty Raw means absent.
    inline_data: msgspec.Raw = msgspec.Raw()
    file_data: msgspec.Raw = msgspec.Raw()
    function_response: msgspec.Raw = msgspec.Raw()
    executable_code: msgspec.Raw = msgspec.Raw()
    code_execution_result: msgspec.Raw = msgspec.Raw()
    tool_call: msgspec.Raw = msgspec.Raw()
    tool_response: msgspec.Raw = msgspec.Raw()


_OTHER_PART_KINDS = {
    "inline_data": "inlineData",
    "file_data": "fileData",
    "function_response": "functionResponse",
    "executable_code": "executableCode",
    "code_execution_result": "codeExecutionResult",
    "tool_call": "toolCall",
    "tool_response": "toolResponse",
}


class _Content(_View):
    parts: list[_Part] = []


class _Candidate(_View):
    content: _Content | None = None
    finish_reason: str | None = None
    index: int = 0  # proto3 JSON omits a zero index


class _PromptFeedback(_View):
    block_reason: str | None = None


class _UsageMetadata(_View):
    prompt_token_count: int | None = None
    candidates_token_count: int | None = None
    thoughts_token_count: int | None = None
    cached_content_token_count: int | None = None
    total_token_count: int | None = None


class _Error(_View):
    code: Any = None
    status: str | None = None
    message: str | None = None
    details: Any = None


class _Chunk(_View):
    candidates: list[_Candidate] = []
    prompt_feedback: _PromptFeedback | None = None
    usage_metadata: _UsageMetadata | None = None
    model_version: str | None = None
    response_id: str | None = None
    error: _Error | None = None


_DECODER = msgspec.json.Decoder(_Chunk)
_ARGS_ENCODER = msgspec.json.Encoder()

# google.rpc canonical HTTP code -> status, for an error object that carries only ``code``.
_HTTP_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def _usage(u: _UsageMetadata) -> Usage:
    # candidatesTokenCount excludes thoughts; output_tokens counts every generated token, as OpenAI's
    # completion_tokens and Anthropic's output_tokens do, with the thoughts also in reasoning_tokens.
    output = None
    if u.candidates_token_count is not None or u.thoughts_token_count is not None:
        output = (u.candidates_token_count or 0) + (u.thoughts_token_count or 0)
    return Usage(
        input_tokens=u.prompt_token_count,
        output_tokens=output,
        reasoning_tokens=u.thoughts_token_count,
        cache_read_tokens=u.cached_content_token_count,
        total_tokens=u.total_token_count,
    )


class GeminiAdapter(Adapter):
    dialect = "gemini"
    provider = "gemini"
    #: finishReason -> stop reason, for the reasons that complete the stream (unknown ones: ``other``).
    #: STOP with a functionCall in the turn becomes ``tool_use`` in the machine.
    STOP_REASONS: ClassVar[dict[str, StopReason]] = {
        "STOP": "stop",
        "MAX_TOKENS": "length",
        "SAFETY": "content_filter",
        "RECITATION": "content_filter",
        "BLOCKLIST": "content_filter",
        "PROHIBITED_CONTENT": "content_filter",
        "SPII": "content_filter",
        "IMAGE_SAFETY": "content_filter",
        "IMAGE_PROHIBITED_CONTENT": "content_filter",
        "IMAGE_RECITATION": "content_filter",
        "MODEL_ARMOR": "content_filter",  # Vertex
        "LANGUAGE": "other",
        "OTHER": "other",
        "FINISH_REASON_UNSPECIFIED": "other",
        "NO_IMAGE": "other",
        "IMAGE_OTHER": "other",
    }
    #: finishReason -> error category, for the reasons that fail the stream. The tool problems leave a
    #: turn whose calls are not a trustworthy set, so none of them may be executed (a failed stream's
    #: result has no parsed arguments); a missing signature is a fault in our request.
    FAILURE_REASONS: ClassVar[dict[str, ErrorCategory]] = {
        "MALFORMED_FUNCTION_CALL": "protocol",
        "UNEXPECTED_TOOL_CALL": "protocol",
        "TOO_MANY_TOOL_CALLS": "protocol",
        "MISSING_THOUGHT_SIGNATURE": "invalid_request",
    }
    #: promptFeedback.blockReason -> stop reason: a blocked prompt is a content filter, whatever the
    #: reason (unknown ones too); the raw reason is kept as provider_stop_reason.
    BLOCK_REASONS: ClassVar[dict[str, StopReason]] = {
        "BLOCKED_REASON_UNSPECIFIED": "content_filter",
        "SAFETY": "content_filter",
        "OTHER": "content_filter",
        "BLOCKLIST": "content_filter",
        "PROHIBITED_CONTENT": "content_filter",
        "IMAGE_SAFETY": "content_filter",
        "MODEL_ARMOR": "content_filter",  # Vertex
        "JAILBREAK": "content_filter",  # Vertex
    }
    #: error.status (google.rpc) -> category; an object with only ``code`` is mapped through
    #: ``_HTTP_STATUS`` first. FAILED_PRECONDITION is Gemini's "enable billing" answer.
    ERROR_CATEGORIES: ClassVar[dict[str, ErrorCategory]] = {
        "UNAVAILABLE": "overloaded",
        "RESOURCE_EXHAUSTED": "rate_limit",
        "INTERNAL": "server_error",
        "DEADLINE_EXCEEDED": "server_error",
        "INVALID_ARGUMENT": "invalid_request",
        "PERMISSION_DENIED": "permission",
        "UNAUTHENTICATED": "authentication",
        "NOT_FOUND": "not_found",
        "FAILED_PRECONDITION": "billing",
    }
    TERMINAL_SIGNALS: ClassVar[dict[str, str]] = {
        "EOF after a candidate finishReason": "completed (STOP_REASONS) or failed (FAILURE_REASONS); "
        "the last finishReason before EOF wins",
        "EOF after promptFeedback.blockReason": "completed / content_filter",
        'data: {"error": {...}}': "failed at once (category from error.status, or an ErrorInfo reason)",
        '{"error": {...}} appended without SSE framing': "failed (as above; the raw log keeps it)",
        "EOF with neither": "interrupted / transport",
    }
    #: google.rpc.ErrorInfo reason in error.details -> category, over the status's
    ERROR_REASONS: ClassVar[dict[str, ErrorCategory]] = ERROR_INFO_REASONS
    UNFRAMED_JSON = True

    def __init__(self) -> None:
        self._started = False
        self._blocks = 0  # keys handed out; a key is the block's ordinal in this stream
        self._open: int | None = None  # key of the open text or reasoning block
        self._open_kind: BlockKind | None = None
        self._open_signed = False  # the open block already holds a signature
        self._finish: str | None = None  # last finishReason seen
        self._block_reason: str | None = None  # promptFeedback.blockReason, if it came last

    def feed(self, sse: SSEEvent) -> list[Action]:
        if sse.unframed:
            return [self._unframed(sse)]
        chunk = _DECODER.decode(sse.data)  # JSON that does not fit: the Normalizer's protocol error
        usage = _usage(chunk.usage_metadata) if chunk.usage_metadata is not None else None
        if chunk.error is not None:
            return [self._error(chunk.error, usage)]
        out: list[Action] = []
        if not self._started:
            self._started = True
            out.append(Start(model=chunk.model_version, response_id=chunk.response_id))
        if usage is not None:
            # Before the parts: a part that fails the stream (a functionCall without a name) ends it,
            # and the usage of the chunk it came in is billed all the same.
            out.append(SetUsage(usage))
        pf = chunk.prompt_feedback
        if pf is not None and pf.block_reason:
            # Sent instead of candidates when the prompt is blocked; like a finishReason it is only
            # final at EOF, so a later finishReason would override it.
            self._block_reason, self._finish = pf.block_reason, None
        cand = next((c for c in chunk.candidates if c.index == 0), None)
        for c in chunk.candidates:
            if c is not cand:
                out.append(Ignore(f"candidate:{c.index}"))  # n > 1 is not normalized
        if cand is not None:
            out += self._candidate(cand)
        elif not chunk.candidates:
            out.append(Ignore("chunk without candidates", unknown=False))
        return out

    def end(self) -> list[Action]:
        """EOF: the remembered finishReason or blockReason is the terminal; without one, nothing
        (the machine reports the interruption). A failure keeps open blocks unclosed in public."""
        if self._finish is not None:
            category = self.FAILURE_REASONS.get(self._finish)
            if category is not None:
                return [
                    Fail(
                        category=category,
                        provider_code=self._finish,
                        message=f"the model stopped with finishReason {self._finish}",
                    )
                ]
            stop = self.stop_reason(self._finish)
            return [*self._close(), Finish(stop_reason=stop, provider_stop_reason=self._finish)]
        if self._block_reason is not None:
            stop = self.BLOCK_REASONS.get(self._block_reason, "content_filter")
            return [*self._close(), Finish(stop_reason=stop, provider_stop_reason=self._block_reason)]
        return []

    # -- internals --------------------------------------------------------------------------------

    def _unframed(self, sse: SSEEvent) -> Action:
        """JSON without SSE framing: the error body a server appended before closing, or junk."""
        try:
            chunk = _DECODER.decode(sse.data)
        except msgspec.DecodeError:
            return Ignore("unframed text")
        if chunk.error is None:
            return Ignore("unframed JSON without an error")
        return self._error(chunk.error, _usage(chunk.usage_metadata) if chunk.usage_metadata is not None else None)

    def _error(self, err: _Error, usage: Usage | None) -> Fail:
        """The error object's failure, with the usage its chunk reported beside it (billed all the same)."""
        reason = error_info_reason(err.details)
        code: str | None = reason
        if reason is not None:
            category = self.ERROR_REASONS[reason]
        else:
            status = err.status or _HTTP_STATUS.get(err.code if isinstance(err.code, int) else -1)
            category, code = self.error_category(status), err.status or as_str(err.code)
        return Fail(
            category=category,
            provider_code=code,
            message=safe_message(err.message, "the provider reported an error"),
            usage=usage,
        )

    def _candidate(self, cand: _Candidate) -> list[Action]:
        out: list[Action] = []
        parts = cand.content.parts if cand.content is not None else []
        if not parts:
            out.append(Ignore("candidate without parts", unknown=False))
        for part in parts:
            out += self._part(part)
        if cand.finish_reason:
            # Not final yet: gateways send a premature STOP mid-stream, so read on until EOF.
            self._finish, self._block_reason = cand.finish_reason, None
        return out

    def _part(self, part: _Part) -> list[Action]:
        sig = part.thought_signature
        if part.function_call is not None:
            return self._function_call(part.function_call, sig)
        if part.text:
            kind: BlockKind = "reasoning" if part.thought else "text"
            out: list[Action] = []
            # A second signature in one block would be concatenated with the first and break both:
            # a signed part that meets an already signed block starts a block of its own.
            if self._open is None or self._open_kind != kind or (sig and self._open_signed):
                out += self._close()
                out.append(self._open_block(kind))
            out.append(Append(self._open, "text", part.text))
            if sig:
                out.append(self._sign(sig))
            return out
        if sig:
            # A signature-only part (``{"text": "", "thoughtSignature": ...}``) signs what came before
            # it; it never opens a block of its own.
            if self._open is not None and not self._open_signed:
                return [self._sign(sig)]
            return [
                Warn(
                    "signature_dropped",
                    "a thoughtSignature on an empty part had no unsigned open block to join; "
                    "it is kept only in the raw log",
                )
            ]
        for attr, wire in _OTHER_PART_KINDS.items():
            if getattr(part, attr):
                return [Ignore(f"part:{wire}")]
        if part.text is not None:
            return [Ignore("empty text part", unknown=False)]
        return [Ignore("part:unknown")]

    def _function_call(self, fc: _FunctionCall, sig: str | None) -> list[Action]:
        if not fc.name:
            # A Fail action, not a raised error, so the parts before it in this chunk are kept.
            return [Fail(category="protocol", provider_code=None, message="a functionCall part has no name")]
        out = self._close()
        key = self._new_key()
        out.append(Open(key, "tool_call", name=fc.name, call_id=fc.id or None))
        if fc.args is not None:
            # Arguments arrive whole, already an object: one delta, parsed by the machine at Close.
            out.append(Append(key, "json_text", _ARGS_ENCODER.encode(fc.args).decode()))
        if sig:
            out.append(Append(key, "signature", sig))
        out.append(Close(key))
        return out

    def _new_key(self) -> int:
        self._blocks += 1
        return self._blocks

    def _open_block(self, kind: BlockKind) -> Open:
        self._open, self._open_kind, self._open_signed = self._new_key(), kind, False
        return Open(self._open, kind)

    def _sign(self, sig: str) -> Append:
        self._open_signed = True
        return Append(self._open, "signature", sig)

    def _close(self) -> list[Action]:
        if self._open is None:
            return []
        key, self._open = self._open, None
        return [Close(key)]

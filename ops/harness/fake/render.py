"""Pure renderers for the local fake provider: an abstract script -> one provider's SSE bytes.

Rule: ``render(dialect, script)`` returns one ``bytes`` item per SSE event, each exactly as that
provider frames it (OpenAI chat: ``data:`` chunks, a usage chunk with ``choices: []`` and ``[DONE]``;
Responses: ``event:`` + ``data:`` with ``sequence_number`` ending in ``response.completed``; Anthropic:
``message_start`` ... ``message_stop`` with a ``ping``; Gemini: CRLF-framed ``data:`` chunks with whole
``functionCall`` parts and no end marker; Bedrock ConverseStream: AWS event-stream frames, ``messageStart``
... ``messageStop`` then ``metadata``). Faults that change the bytes of a stream (broken JSON,
invalid UTF-8, a dropped terminal, a truncated tool call, a mid-stream error event) are pure
transformations of that list (``inject``); faults of the transport (pacing, chunking, resets) belong to
the server. No IO, no clock, no randomness: the same script always renders the same bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from sluice.normalizer.eventstream import EventStreamDecoder, encode_frame

__all__ = [
    "DIALECTS",
    "ERROR_KINDS",
    "STAMP_PLACEHOLDER",
    "Reasoning",
    "Script",
    "ScriptBlock",
    "StopKind",
    "Tagged",
    "Text",
    "ToolCall",
    "error_body",
    "inject",
    "reframe",
    "render",
    "render_error",
    "render_tagged",
    "split_events",
]

DIALECTS: tuple[str, ...] = ("openai-chat", "openai-responses", "anthropic", "gemini", "bedrock-converse")
ERROR_KINDS: tuple[str, ...] = ("overloaded", "rate_limit", "server_error")
# A text delta that starts with this placeholder gets the send time written over the zeros by the server
# ("⏱<unix µs, 16 digits>|"): fixed width, so the rendered JSON stays valid whatever the time.
STAMP_PLACEHOLDER = "⏱0000000000000000|"

StopKind = Literal["stop", "tool_use", "length"]


@dataclass(frozen=True, slots=True)
class Text:
    deltas: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reasoning:
    deltas: tuple[str, ...]
    signature: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    call_id: str  # provider prefixes (call_, toolu_, fc_) are added by each renderer
    fragments: tuple[str, ...]  # argument JSON text, split anywhere

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)


ScriptBlock = Text | Reasoning | ToolCall


@dataclass(frozen=True, slots=True)
class Script:
    model: str
    blocks: tuple[ScriptBlock, ...]
    stop: StopKind = "stop"
    input_tokens: int = 0
    output_tokens: int = 0
    id: str = "0000000000000000"  # the provider's response/message id, without its prefix
    created: int = 1760000000  # unix seconds, stamped on OpenAI chunks and Responses objects


#: One rendered event and what it carries, so faults can find e.g. the terminal or a tool fragment.
#: Tags: meta, ping, text, reasoning, tool (announce/close), tool_args, terminal.
Tagged = tuple[str, bytes]

_ENC = msgspec.json.Encoder()


def _j(obj: Any) -> bytes:
    return _ENC.encode(obj)


def _sse(data: Any, event: str | None = None, eol: bytes = b"\n") -> bytes:
    payload = data if isinstance(data, bytes) else _j(data)
    head = b"event: " + event.encode() + eol if event else b""
    return head + b"data: " + payload + eol + eol


def render(dialect: str, script: Script) -> list[bytes]:
    """One ``bytes`` per SSE event. Raises ``ValueError`` for an unknown dialect."""
    return [data for _, data in render_tagged(dialect, script)]


def render_tagged(dialect: str, script: Script) -> list[Tagged]:
    try:
        renderer = _RENDERERS[dialect]
    except KeyError:
        raise ValueError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}") from None
    return renderer(script)


# -- OpenAI Chat Completions ---------------------------------------------------------------------------


def _openai_chat(s: Script) -> list[Tagged]:
    base = {
        "id": f"chatcmpl-{s.id}",
        "object": "chat.completion.chunk",
        "created": s.created,
        "model": s.model,
        "service_tier": "default",
        "system_fingerprint": "fp_fake0001",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        # stream_options.include_usage=true: every chunk says "usage": null until the usage chunk.
        return _sse({**base, "choices": [choice], "usage": None})

    out: list[Tagged] = [("meta", chunk({"role": "assistant", "content": "", "refusal": None}))]
    tool_index = 0  # tool_calls[].index numbers the calls only, not the blocks
    for block in s.blocks:
        if isinstance(block, Text):
            out += [("text", chunk({"content": d})) for d in block.deltas]
        elif isinstance(block, Reasoning):
            # Chat has no reasoning field of its own; OpenAI-compatible servers (DeepSeek, vLLM) use this.
            out += [("reasoning", chunk({"reasoning_content": d})) for d in block.deltas]
        else:
            first = {
                "index": tool_index,
                "id": f"call_{block.call_id}",
                "type": "function",
                "function": {"name": block.name, "arguments": ""},
            }
            out.append(("tool", chunk({"tool_calls": [first]})))
            out += [
                ("tool_args", chunk({"tool_calls": [{"index": tool_index, "function": {"arguments": f}}]}))
                for f in block.fragments
            ]
            tool_index += 1
    finish = {"stop": "stop", "tool_use": "tool_calls", "length": "length"}[s.stop]
    out.append(("meta", chunk({}, finish)))
    usage = {
        "prompt_tokens": s.input_tokens,
        "completion_tokens": s.output_tokens,
        "total_tokens": s.input_tokens + s.output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    out.append(("meta", _sse({**base, "choices": [], "usage": usage})))
    out.append(("terminal", b"data: [DONE]\n\n"))
    return out


# -- OpenAI Responses ---------------------------------------------------------------------------------


def _responses_object(s: Script, status: str, output: list[Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": f"resp_{s.id}",
        "object": "response",
        "created_at": s.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": s.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": {},
        **extra,
    }


class _Responses:
    """Stateful only while rendering one script: the running ``sequence_number``."""

    def __init__(self, s: Script) -> None:
        self.s = s
        self.seq = 0
        self.out: list[Tagged] = []

    def emit(self, tag: str, type_: str, **fields: Any) -> None:
        self.out.append((tag, _sse({"type": type_, "sequence_number": self.seq, **fields}, event=type_)))
        self.seq += 1

    def run(self) -> list[Tagged]:
        s = self.s
        self.emit("meta", "response.created", response=_responses_object(s, "in_progress", []))
        self.emit("meta", "response.in_progress", response=_responses_object(s, "in_progress", []))
        output: list[Any] = []
        for i, block in enumerate(s.blocks):
            if isinstance(block, Text):
                output.append(self._message(i, block))
            elif isinstance(block, Reasoning):
                output.append(self._reasoning(i, block))
            else:
                output.append(self._function_call(i, block))
        usage = {
            "input_tokens": s.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": s.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.input_tokens + s.output_tokens,
        }
        if s.stop == "length":
            done = _responses_object(
                s, "incomplete", output, usage=usage, incomplete_details={"reason": "max_output_tokens"}
            )
            self.emit("terminal", "response.incomplete", response=done)
        else:
            # No tool-specific status: tool use is read from the function_call items.
            self.emit(
                "terminal",
                "response.completed",
                response=_responses_object(s, "completed", output, usage=usage),
            )
        return self.out

    def _message(self, i: int, block: Text) -> dict[str, Any]:
        item_id = f"msg_{self.s.id}{i:02d}"
        text = "".join(block.deltas)
        part_empty = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        part = {**part_empty, "text": text}
        ids = {"item_id": item_id, "output_index": i, "content_index": 0}
        item = {"id": item_id, "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        self.emit("meta", "response.output_item.added", output_index=i, item=item)
        self.emit("meta", "response.content_part.added", **ids, part=part_empty)
        for d in block.deltas:
            self.emit("text", "response.output_text.delta", **ids, delta=d, logprobs=[])
        self.emit("meta", "response.output_text.done", **ids, text=text, logprobs=[])
        self.emit("meta", "response.content_part.done", **ids, part=part)
        done = {**item, "status": "completed", "content": [part]}
        self.emit("meta", "response.output_item.done", output_index=i, item=done)
        return done

    def _reasoning(self, i: int, block: Reasoning) -> dict[str, Any]:
        item_id = f"rs_{self.s.id}{i:02d}"
        text = "".join(block.deltas)
        ids = {"item_id": item_id, "output_index": i, "summary_index": 0}
        self.emit(
            "meta",
            "response.output_item.added",
            output_index=i,
            item={"id": item_id, "type": "reasoning", "summary": []},
        )
        self.emit("meta", "response.reasoning_summary_part.added", **ids, part={"type": "summary_text", "text": ""})
        for d in block.deltas:
            self.emit("reasoning", "response.reasoning_summary_text.delta", **ids, delta=d)
        self.emit("meta", "response.reasoning_summary_text.done", **ids, text=text)
        self.emit("meta", "response.reasoning_summary_part.done", **ids, part={"type": "summary_text", "text": text})
        done: dict[str, Any] = {
            "id": item_id,
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}],
        }
        if block.signature is not None:
            # Only sent with include: ["reasoning.encrypted_content"]; the value on output_item.done counts.
            done["encrypted_content"] = block.signature
        self.emit("meta", "response.output_item.done", output_index=i, item=done)
        return done

    def _function_call(self, i: int, block: ToolCall) -> dict[str, Any]:
        item_id = f"fc_{self.s.id}{i:02d}"
        item = {
            "id": item_id,
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": f"call_{block.call_id}",
            "name": block.name,
        }
        self.emit("tool", "response.output_item.added", output_index=i, item=item)
        for f in block.fragments:
            self.emit(
                "tool_args",
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=i,
                delta=f,
            )
        args = block.arguments
        self.emit(
            "tool",
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=i,
            name=block.name,
            arguments=args,
        )
        done = {**item, "status": "completed", "arguments": args}
        self.emit("tool", "response.output_item.done", output_index=i, item=done)
        return done


def _openai_responses(s: Script) -> list[Tagged]:
    return _Responses(s).run()


# -- Anthropic Messages ------------------------------------------------------------------------------


def _anthropic(s: Script) -> list[Tagged]:
    def ev(tag: str, type_: str, **fields: Any) -> Tagged:
        return (tag, _sse({"type": type_, **fields}, event=type_))

    message: dict[str, Any] = {
        "id": f"msg_{s.id}",
        "type": "message",
        "role": "assistant",
        "model": s.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": s.input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 1,
            "service_tier": "standard",
        },
    }
    out = [ev("meta", "message_start", message=message)]
    for i, block in enumerate(s.blocks):
        if isinstance(block, Text):
            out.append(ev("meta", "content_block_start", index=i, content_block={"type": "text", "text": ""}))
            out += [
                ev("text", "content_block_delta", index=i, delta={"type": "text_delta", "text": d})
                for d in block.deltas
            ]
        elif isinstance(block, Reasoning):
            cb: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}  # "" is a placeholder at start
            out.append(ev("meta", "content_block_start", index=i, content_block=cb))
            out += [
                ev(
                    "reasoning",
                    "content_block_delta",
                    index=i,
                    delta={"type": "thinking_delta", "thinking": d},
                )
                for d in block.deltas
            ]
            if block.signature is not None:
                sig = {"type": "signature_delta", "signature": block.signature}
                out.append(ev("meta", "content_block_delta", index=i, delta=sig))
        else:
            cb = {"type": "tool_use", "id": f"toolu_{block.call_id}", "name": block.name, "input": {}}
            out.append(ev("tool", "content_block_start", index=i, content_block=cb))
            # The first input_json_delta is often empty; the real input comes only from the deltas.
            out.append(
                ev("tool", "content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": ""})
            )
            out += [
                ev("tool_args", "content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": f})
                for f in block.fragments
            ]
        out.append(ev("tool" if isinstance(block, ToolCall) else "meta", "content_block_stop", index=i))
    out.insert(min(2, len(out)), ev("ping", "ping"))  # the API sends one early (after the first block start)
    reason = {"stop": "end_turn", "tool_use": "tool_use", "length": "max_tokens"}[s.stop]
    out.append(
        ev(
            "meta",
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": None},
            usage={"output_tokens": s.output_tokens},
        )
    )
    out.append(ev("terminal", "message_stop"))
    return out


# -- Gemini --------------------------------------------------------------------------------------------


def _gj(obj: Any) -> bytes:
    # Gemini's JSON uses ": " and "," separators; consumers must parse it, never string-match it.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ": ")).encode()


def _gemini(s: Script) -> list[Tagged]:
    prompt = {"promptTokenCount": s.input_tokens, "totalTokenCount": s.input_tokens}

    def chunk(tag: str, parts: list[dict[str, Any]], usage: dict[str, Any] = prompt, **cand: Any) -> Tagged:
        candidate = {"content": {"parts": parts, "role": "model"}, **cand, "index": 0}
        body = {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": s.model,
            "responseId": s.id,
        }
        return (tag, _sse(_gj(body), eol=b"\r\n"))

    out: list[Tagged] = []
    malformed = False
    for block in s.blocks:
        if isinstance(block, Text):
            out += [chunk("text", [{"text": d}]) for d in block.deltas]
        elif isinstance(block, Reasoning):
            for n, d in enumerate(block.deltas, 1):
                part: dict[str, Any] = {"text": d, "thought": True}
                if n == len(block.deltas) and block.signature is not None:
                    part["thoughtSignature"] = block.signature  # opaque, kept with the part it came on
                out.append(chunk("reasoning", [part]))
        else:
            try:
                args = json.loads(block.arguments or "{}")
            except ValueError:
                args = None
            if not isinstance(args, dict):
                # Gemini calls arrive whole, so bad arguments never reach the wire: the model's
                # failure is reported as finishReason MALFORMED_FUNCTION_CALL instead.
                malformed = True
                continue
            # The Gemini API usually omits functionCall.id; the consumer pairs calls by position.
            out.append(chunk("tool_args", [{"functionCall": {"name": block.name, "args": args}}]))
    reason = (
        "MALFORMED_FUNCTION_CALL" if malformed else {"stop": "STOP", "tool_use": "STOP", "length": "MAX_TOKENS"}[s.stop]
    )
    total = {
        "promptTokenCount": s.input_tokens,
        "candidatesTokenCount": s.output_tokens,
        "totalTokenCount": s.input_tokens + s.output_tokens,
    }
    # No end marker exists: the last chunk carries finishReason, then the server closes (EOF).
    out.append(chunk("terminal", [{"text": ""}], total, finishReason=reason))
    return out


# -- Bedrock ConverseStream ------------------------------------------------------------------------------

_BEDROCK_STOP = {"stop": "end_turn", "tool_use": "tool_use", "length": "max_tokens"}
# kind -> the ConverseStream exception type the error comes as
_BEDROCK_EXCEPTIONS = {
    "overloaded": "serviceUnavailableException",
    "rate_limit": "throttlingException",
    "server_error": "internalServerException",
}


def _frame_event(event_type: str, payload: dict[str, Any]) -> bytes:
    headers = {":event-type": event_type, ":content-type": "application/json", ":message-type": "event"}
    return encode_frame(headers, _j({**payload, "p": "abcdefghijklmnop"[: 1 + len(event_type) % 16]}))


def _frame_exception(exception_type: str, message: str) -> bytes:
    headers = {":exception-type": exception_type, ":content-type": "application/json", ":message-type": "exception"}
    return encode_frame(headers, _j({"message": message}))


def _bedrock(s: Script) -> list[Tagged]:
    def ev(tag: str, event_type: str, **payload: Any) -> Tagged:
        return (tag, _frame_event(event_type, payload))

    out = [ev("meta", "messageStart", role="assistant")]
    for i, block in enumerate(s.blocks):
        if isinstance(block, Text):
            out += [ev("text", "contentBlockDelta", contentBlockIndex=i, delta={"text": d}) for d in block.deltas]
        elif isinstance(block, Reasoning):
            out += [
                ev("reasoning", "contentBlockDelta", contentBlockIndex=i, delta={"reasoningContent": {"text": d}})
                for d in block.deltas
            ]
            if block.signature is not None:
                sig = {"reasoningContent": {"signature": block.signature}}
                out.append(ev("meta", "contentBlockDelta", contentBlockIndex=i, delta=sig))
        else:
            start = {"toolUse": {"toolUseId": f"tooluse_{block.call_id}", "name": block.name}}
            out.append(ev("tool", "contentBlockStart", contentBlockIndex=i, start=start))
            out += [
                ev("tool_args", "contentBlockDelta", contentBlockIndex=i, delta={"toolUse": {"input": f}})
                for f in block.fragments
            ]
        out.append(ev("tool" if isinstance(block, ToolCall) else "meta", "contentBlockStop", contentBlockIndex=i))
    out.append(ev("meta", "messageStop", stopReason=_BEDROCK_STOP[s.stop]))
    usage = {"inputTokens": s.input_tokens, "outputTokens": s.output_tokens}
    usage["totalTokens"] = s.input_tokens + s.output_tokens
    # metadata follows messageStop: it is the stream's completion proof (the "terminal" a fault may drop).
    out.append(ev("terminal", "metadata", usage=usage, metrics={"latencyMs": 120}))
    return out


def reframe(frame: bytes, change: Callable[[bytes], bytes]) -> bytes:
    """An event-stream frame with its payload changed and its CRCs made right again (a body fault must be
    the fault it names, not a CRC mismatch)."""
    [msg] = EventStreamDecoder().feed(frame)
    assert msg.headers is not None and msg.frame is not None
    head_len = int.from_bytes(frame[4:8], "big")
    return encode_frame(msg.headers, change(frame[12 + head_len : -4]))


_RENDERERS: dict[str, Callable[[Script], list[Tagged]]] = {
    "openai-chat": _openai_chat,
    "openai-responses": _openai_responses,
    "anthropic": _anthropic,
    "gemini": _gemini,
    "bedrock-converse": _bedrock,
}


# -- errors --------------------------------------------------------------------------------------------

# kind -> (OpenAI type, OpenAI code, Anthropic type, Gemini code, Gemini status, message)
_ERRORS: dict[str, tuple[str, str | None, str, int, str, str]] = {
    "overloaded": (
        "server_error",
        "server_is_overloaded",
        "overloaded_error",
        503,
        "UNAVAILABLE",
        "The model is overloaded. Please try again later.",
    ),
    "rate_limit": (
        "requests",
        "rate_limit_exceeded",
        "rate_limit_error",
        429,
        "RESOURCE_EXHAUSTED",
        "Rate limit reached. Please try again later.",
    ),
    "server_error": (
        "server_error",
        None,
        "api_error",
        500,
        "INTERNAL",
        "The server had an error while processing your request.",
    ),
}


def render_error(dialect: str, script: Script, kind: str = "overloaded", seq: int = 0) -> list[bytes]:
    """The dialect's mid-stream error (sent after HTTP 200), after which the server closes.

    ``seq`` is the next Responses ``sequence_number``. Raises ``ValueError`` for an unknown kind.
    """
    if kind not in _ERRORS:
        raise ValueError(f"unknown error kind {kind!r}; known: {', '.join(ERROR_KINDS)}")
    oa_type, oa_code, an_type, g_code, g_status, message = _ERRORS[kind]
    if dialect == "bedrock-converse":
        return [_frame_exception(_BEDROCK_EXCEPTIONS[kind], message)]
    if dialect == "openai-chat":
        # A data line with a top-level "error" and no choices; usually no [DONE] follows.
        return [_sse({"error": {"message": message, "type": oa_type, "param": None, "code": oa_code}})]
    if dialect == "openai-responses":
        code = oa_code or oa_type
        failed = _responses_object(script, "failed", [], error={"code": code, "message": message})
        return [
            _sse(
                {"type": "error", "sequence_number": seq, "code": code, "message": message, "param": None},
                event="error",
            ),
            _sse({"type": "response.failed", "sequence_number": seq + 1, "response": failed}, event="response.failed"),
        ]
    if dialect == "anthropic":
        body = {
            "type": "error",
            "error": {"type": an_type, "message": message},
            "request_id": f"req_{script.id}",
        }
        return [_sse(body, event="error")]
    if dialect == "gemini":
        return [_sse(_gj({"error": {"code": g_code, "message": message, "status": g_status}}), eol=b"\r\n")]
    raise ValueError(f"unknown dialect {dialect!r}")


# HTTP status -> (OpenAI type, OpenAI code, Anthropic type, Gemini status)
_HTTP_ERRORS: dict[int, tuple[str, str | None, str, str]] = {
    400: ("invalid_request_error", None, "invalid_request_error", "INVALID_ARGUMENT"),
    401: ("invalid_request_error", "invalid_api_key", "authentication_error", "UNAUTHENTICATED"),
    402: ("insufficient_quota", "insufficient_quota", "billing_error", "FAILED_PRECONDITION"),
    403: ("invalid_request_error", "permission_denied", "permission_error", "PERMISSION_DENIED"),
    404: ("invalid_request_error", "model_not_found", "not_found_error", "NOT_FOUND"),
    408: ("server_error", "timeout", "timeout_error", "DEADLINE_EXCEEDED"),
    413: ("invalid_request_error", "request_too_large", "request_too_large", "INVALID_ARGUMENT"),
    429: ("requests", "rate_limit_exceeded", "rate_limit_error", "RESOURCE_EXHAUSTED"),
    500: ("server_error", None, "api_error", "INTERNAL"),
    502: ("server_error", None, "api_error", "UNAVAILABLE"),
    503: ("server_error", "server_is_overloaded", "overloaded_error", "UNAVAILABLE"),
    504: ("server_error", "timeout", "timeout_error", "DEADLINE_EXCEEDED"),
    529: ("server_error", "server_is_overloaded", "overloaded_error", "UNAVAILABLE"),
}


def error_body(
    dialect: str,
    status: int,
    message: str,
    request_id: str = "req_fake",
    *,
    retry_delay_s: float | None = None,
    quota_id: str | None = None,
) -> bytes:
    """The JSON body of an HTTP error response, in the provider's own shape. Gemini (google.rpc.Status)
    carries its retry hint and the exhausted quota in ``details`` (``RetryInfo``, ``QuotaFailure``); the
    other dialects send them as headers only, so there the two arguments change nothing."""
    default = (
        ("server_error", None, "api_error", "INTERNAL")
        if status >= 500
        else ("invalid_request_error", None, "invalid_request_error", "INVALID_ARGUMENT")
    )
    oa_type, oa_code, an_type, g_status = _HTTP_ERRORS.get(status, default)
    if dialect == "bedrock-converse":  # the error's type travels in the x-amzn-ErrorType header
        return _j({"message": message})
    if dialect == "anthropic":
        return _j({"type": "error", "error": {"type": an_type, "message": message}, "request_id": request_id})
    if dialect == "gemini":
        error: dict[str, Any] = {"code": status, "message": message, "status": g_status}
        details: list[dict[str, Any]] = []
        if quota_id is not None:
            violation = {
                "quotaMetric": "generativelanguage.googleapis.com/generate_content_requests",
                "quotaId": quota_id,
            }
            details.append({"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [violation]})
        if retry_delay_s is not None:  # a protobuf Duration in JSON: seconds with an "s"
            details.append(
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": _duration(retry_delay_s)}
            )
        if details:
            error["details"] = details
        return _gj({"error": error})
    return _j({"error": {"message": message, "type": oa_type, "param": None, "code": oa_code}})


def _duration(seconds: float) -> str:
    """A google.protobuf.Duration in its JSON form: seconds, up to millisecond digits, then ``s``."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


# -- faults on the event list ------------------------------------------------------------------------------

_DATA_LINE = re.compile(rb"(^|\n)data: ?([^\r\n]*)")


def inject(
    dialect: str,
    script: Script,
    events: Sequence[Tagged],
    *,
    malformed_json: int = 0,
    invalid_utf8: int = 0,
    truncate_tool: bool = False,
    drop_terminal: bool = False,
    error_after: int | None = None,
    error_kind: str = "overloaded",
) -> list[Tagged]:
    """Apply the body faults of a scenario. Event numbers count from 1, like raw event indices.

    - ``malformed_json=N``: event N's data loses its last ``}`` (``[DONE]`` becomes ``{``).
    - ``invalid_utf8=N``: the first text or reasoning delta at or after event N gets a 0xFF byte at the
      start of its text (event N's data when no delta follows).
    - ``truncate_tool``: EOF in the middle of the first tool call's arguments: after its first fragment,
      plus half of the next event's bytes (for Gemini, half of the whole-call event).
    - ``drop_terminal``: everything but the terminal marker.
    - ``error_after=N``: the first N events, then the dialect's mid-stream error event(s).
    """
    out = list(events)
    framed = dialect == "bedrock-converse"
    if malformed_json and 0 < malformed_json <= len(out):
        tag, data = out[malformed_json - 1]
        out[malformed_json - 1] = (tag, reframe(data, _drop_last_brace) if framed else _break_json(data))
    if invalid_utf8 and out:
        start = min(max(invalid_utf8, 1), len(out)) - 1
        at = next((i for i in range(start, len(out)) if out[i][0] in ("text", "reasoning")), start)
        tag, data = out[at]
        out[at] = (tag, reframe(data, _add_invalid_utf8) if framed else _add_invalid_utf8(data))
    if truncate_tool:
        first = next((i for i, (tag, _) in enumerate(out) if tag == "tool_args"), None)
        if first is not None:
            # Gemini sends each call whole in one event: cut that one.
            more = dialect != "gemini" and first + 1 < len(out) and out[first + 1][0] == "tool_args"
            cut = first + 1 if more else first
            tag, data = out[cut]
            out = [*out[:cut], (tag, data[: len(data) // 2])]
    if drop_terminal:
        out = [e for e in out if e[0] != "terminal"]
    if error_after is not None:
        kept = out[:error_after]
        out = kept + [("meta", e) for e in render_error(dialect, script, error_kind, seq=len(kept))]
    return out


def _drop_last_brace(payload: bytes) -> bytes:
    at = payload.rfind(b"}")
    return payload[:at] + payload[at + 1 :] if at >= 0 else b"{"


def _break_json(event: bytes) -> bytes:
    m = _DATA_LINE.search(event)
    if m is None:
        return event
    data = m.group(2)
    broken = data[: data.rindex(b"}")] + data[data.rindex(b"}") + 1 :] if b"}" in data else b"{"
    return event[: m.start(2)] + broken + event[m.end(2) :]


# The JSON string that carries a delta's text in each dialect: chat content / reasoning_content,
# Responses delta, Anthropic text / thinking, Gemini text.
_TEXT_VALUE = re.compile(rb'"(?:content|reasoning_content|delta|text|thinking)": ?"')


def _add_invalid_utf8(event: bytes) -> bytes:
    # At the start of the delta's text, so the payload is still JSON once a decoder replaces the byte with
    # U+FFFD; an event without text gets it at the start of its data.
    m = _TEXT_VALUE.search(event) or _DATA_LINE.search(event)
    if m is None:
        return event + b"\xff"
    at = m.end() if m.re is _TEXT_VALUE else m.start(2)
    return event[:at] + b"\xff" + event[at:]


# A lone CR must not be the CR of a CRLF, or "\r\n" alone would read as an empty line.
_EOL = rb"(?:\r\n|\r(?!\n)|\n)"
_EVENT_END = re.compile(_EOL + _EOL)


def split_events(raw: bytes) -> list[bytes]:
    """Split a recorded body into events, byte for byte: each piece ends after its blank line (a
    trailing piece without one is kept as is), so ``b"".join(split_events(x)) == x``."""
    pieces: list[bytes] = []
    start = 0
    for m in _EVENT_END.finditer(raw):
        pieces.append(raw[start : m.end()])
        start = m.end()
    if start < len(raw):
        pieces.append(raw[start:])
    return pieces

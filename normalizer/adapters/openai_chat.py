"""OpenAI Chat Completions streaming (``POST /v1/chat/completions``, ``stream: true``) to contract actions,
for OpenAI and the compatible servers pointed at this dialect (OpenRouter, Groq, DeepSeek, vLLM, Azure,
Ollama ``/v1``).

Rule: ``data: [DONE]`` is the only success terminal: it closes every open block (tool arguments are
parsed there, by the machine) and finishes with the last ``finish_reason`` seen on choice 0. A
``finish_reason`` without ``[DONE]`` before EOF is an interruption (the machine reports it). An
``{"error": ...}`` data line (no choices; also an OpenRouter chunk whose ``error`` sits beside
``finish_reason: "error"``), an ``event: error``, a vLLM ``{"object": "error"}`` body or a failing
``finish_reason`` (``FAILURE_FINISH_REASONS``) fails the stream.

Block order follows the wire. Chat has no block boundaries, so this adapter draws them:

- ``reasoning_content`` (DeepSeek, older vLLM) or ``reasoning`` (vLLM, OpenRouter) is reasoning,
  ``content`` is text, ``refusal`` is a refusal. These are *sequential*: at most one is open. A fragment
  of another sequential kind closes it; a sequential fragment also closes every open tool call, since
  text after a call means the call is complete (text, tool, text gives blocks 0, 1, 2).
- Tool calls are *parallel*: one delta may carry fragments for several ``tool_calls[].index`` values,
  so a fragment for one index never closes another index. A tool fragment closes the open sequential
  block. Fragments are routed by ``index`` and ``id`` together: an ``id`` different from the open call's
  at the same index starts a new block (never concatenated); a fragment without an ``id`` continues the
  open call at its index (a first fragment without an ``id`` but with a name opens a call whose id the
  machine synthesizes); argument text for an index with no open call is a protocol error.
- ``content`` may be a list of typed parts (Mistral's reasoning models: ``{"type": "thinking",
  "thinking": [{"type": "text", ...}]}`` and ``{"type": "text", "text"}``): each ``thinking`` part is a
  reasoning fragment, each ``text`` part a text fragment, in the list's order, under the same
  sequential rule (so thinking then text is two blocks, never merged); other part types are counted
  and skipped.
- Within one delta the order is reasoning, content, refusal, tool calls. Empty strings are no content
  and never open or close anything.

Only choice ``index`` 0 is normalized: the contract has one turn per stream, so fragments of any other
choice (``n > 1``) are ignored and counted as unknown (reported in a ``stream.warning``). Jobs asking for
``n > 1`` are unsupported.

Usage comes from the top-level ``usage`` (the ``include_usage`` chunk with ``choices: []``, ``null`` or
missing) or Groq's ``x_groq.usage``; later values replace earlier ones field by field. A chunk that fails
the stream keeps the usage beside its error (a router's ``{"error": ..., "usage": ...}``): it rides on
the failure into ``stream.error``. Azure's leading
``prompt_filter_results`` chunk and annotation-only choices (no ``delta``) carry nothing to normalize.
``stream.start`` is emitted on the first chunk that names a model or carries anything to normalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar

import msgspec

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, SetUsage, Start
from sluice.normalizer.adapters.base import Adapter, as_str, safe_message
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.errors import ProviderProtocolError
from sluice.schemas.events import BlockKind, ErrorCategory, StopReason, Usage

__all__ = ["OpenAIChatAdapter"]


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None  # OpenRouter


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None
    prompt_cache_hit_tokens: int | None = None  # DeepSeek
    cost: float | int | None = None  # OpenRouter: what the request cost, in US dollars of credits


class _XGroq(msgspec.Struct):
    usage: _Usage | None = None


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: Any = None  # a JSON text; a few servers send the object itself


class _ToolCall(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: _Function | None = None


class _ContentPart(msgspec.Struct):
    """One typed part of a list ``delta.content`` (Mistral's ``TextChunk`` / ``ThinkChunk``)."""

    type: str = ""
    text: str | None = None
    thinking: str | list[_ContentPart] | None = None  # a ThinkChunk's own parts (text, reference)


class _Delta(msgspec.Struct):
    content: Any = None  # a string; Mistral reasoning models send a list of typed parts (_ContentPart)
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCall] | None = None
    function_call: _Function | None = None  # deprecated single-call form, no id


class _Choice(msgspec.Struct):
    index: int | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None
    error: Any = None  # OpenRouter also puts the error on the choice


class _Chunk(msgspec.Struct):
    id: str | None = None
    object: str | None = None
    model: str | None = None
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    x_groq: _XGroq | None = None
    error: Any = None
    prompt_filter_results: Any = None
    # vLLM's older error body is the error object itself: {"object": "error", "message", "type", "code"}
    message: Any = None
    type: Any = None
    code: Any = None


_DECODER = msgspec.json.Decoder(_Chunk)
_JSON = msgspec.json.Encoder()
_FUNCTION_CALL_INDEX = -1  # the deprecated ``delta.function_call`` is one call without an index


@dataclass(slots=True)
class _OpenTool:
    key: tuple[BlockKind, int]
    call_id: str | None


def _usage(u: _Usage) -> Usage:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
    return Usage(
        input_tokens=u.prompt_tokens,
        output_tokens=u.completion_tokens,
        reasoning_tokens=u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else None,
        cache_read_tokens=cached if cached is not None else u.prompt_cache_hit_tokens,
        cache_write_tokens=u.prompt_tokens_details.cache_write_tokens if u.prompt_tokens_details else None,
        total_tokens=u.total_tokens,
        provider_cost=_decimal_text(u.cost) if u.cost is not None else msgspec.UNSET,
    )


def _decimal_text(value: float | int) -> str:
    """A reported number as a plain decimal string (``repr`` of a float is its shortest exact-enough form)."""
    text = format(Decimal(repr(value)), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _arguments_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return _JSON.encode(value).decode()  # Ollama-style whole object: re-encode, never reinterpret


class OpenAIChatAdapter(Adapter):
    dialect = "openai-chat"
    provider = "openai"
    STOP_REASONS: ClassVar[dict[str, StopReason]] = {
        "stop": "stop",  # upgraded to tool_use / refusal by the machine when the turn had them
        "tool_calls": "tool_use",
        "function_call": "tool_use",
        "length": "length",
        "model_length": "length",  # Mistral
        "content_filter": "content_filter",
    }
    #: finish reasons that are failures, not stops: finish_reason -> error category
    FAILURE_FINISH_REASONS: ClassVar[dict[str, ErrorCategory]] = {
        "error": "server_error",  # OpenRouter, Mistral; an error object beside it takes precedence
        "insufficient_system_resource": "overloaded",  # DeepSeek: generation cut for lack of capacity
    }
    #: error.code (or error.type) -> category; codes are looked up first, then types
    ERROR_CATEGORIES: ClassVar[dict[str, ErrorCategory]] = {
        # OpenAI codes and types
        "server_error": "server_error",
        "api_error": "server_error",
        "internal_error": "server_error",
        "internal_server_error": "server_error",
        "timeout": "server_error",
        "overloaded": "overloaded",
        "overloaded_error": "overloaded",
        "server_is_overloaded": "overloaded",
        "engine_overloaded": "overloaded",
        "rate_limit_exceeded": "rate_limit",
        "rate_limit_error": "rate_limit",
        "requests": "rate_limit",
        "tokens": "rate_limit",
        "slow_down": "rate_limit",
        "insufficient_quota": "billing",  # a 429, but no retry helps until the account is paid
        "billing_hard_limit_reached": "billing",
        "billing_not_active": "billing",
        "invalid_request_error": "invalid_request",
        "context_length_exceeded": "invalid_request",
        "content_filter": "invalid_request",  # Azure: the prompt was filtered
        "invalid_api_key": "authentication",
        "invalid_authentication": "authentication",
        "authentication_error": "authentication",
        "permission_error": "permission",
        "unsupported_country_region_territory": "permission",
        "model_not_found": "not_found",
        "not_found_error": "not_found",
        # vLLM error types
        "BadRequestError": "invalid_request",
        "NotFoundError": "not_found",
        "InternalServerError": "server_error",
        # OpenRouter (and vLLM) send HTTP-style numbers
        "400": "invalid_request",
        "401": "authentication",
        "402": "billing",
        "403": "permission",
        "404": "not_found",
        "408": "server_error",
        "413": "invalid_request",
        "429": "rate_limit",
        "500": "server_error",
        "502": "server_error",
        "503": "overloaded",
        "504": "server_error",
        "529": "overloaded",
    }
    TERMINAL_SIGNALS: ClassVar[dict[str, str]] = {
        "data: [DONE]": "completed (stop reason from the last finish_reason of choice 0)",
        'data: {"error": ...}': "failed (category from error.code, else error.type)",
        'event: error, or vLLM\'s {"object": "error"}': "failed (same lookup)",
        'finish_reason "error"': "failed (OpenRouter, Mistral; category from the error object if any)",
        'finish_reason "insufficient_system_resource"': "failed / overloaded (DeepSeek)",
        "EOF before [DONE]": "interrupted / transport (also after a finish_reason)",
    }

    def __init__(self) -> None:
        self._started = False
        self._serial = 0  # makes every block key unique, so a reused provider index is a new block
        self._open: dict[tuple[BlockKind, int], None] = {}  # every open block key, in opening order
        self._sequential: tuple[BlockKind, int] | None = None  # the open text / reasoning / refusal block
        self._tools: dict[int, _OpenTool] = {}  # open tool calls by provider index
        self._closed_call_ids: set[str] = set()
        self._finish_reason: str | None = None

    # -- the interface ----------------------------------------------------------------------------

    def feed(self, sse: SSEEvent) -> list[Action]:
        data = sse.data
        if data.startswith("[DONE]"):  # the SDK's own test; nothing else may follow
            return self._done()
        if sse.event not in ("", "message", "error"):
            return [Ignore(f"event:{sse.event}")]
        if not data.strip():
            return [Ignore("empty data", unknown=False)]
        chunk = _DECODER.decode(sse.data)  # JSON that does not fit: the Normalizer's protocol error
        out = self._chunk(chunk, sse)
        if not self._started and (chunk.model or any(not isinstance(a, Ignore) for a in out)):
            self._started = True
            out.insert(0, Start(model=chunk.model or None, response_id=chunk.id or None))
        return out or [Ignore("empty chunk", unknown=False)]

    @classmethod
    def error_category(cls, code: str | None, type_: str | None = None) -> ErrorCategory:
        """The category of ``error.code``, else of ``error.type`` (OpenAI often leaves ``code`` null)."""
        for key in (code, type_):
            if key is not None and key in cls.ERROR_CATEGORIES:
                return cls.ERROR_CATEGORIES[key]
        return "unknown"

    # -- chunks -----------------------------------------------------------------------------------

    def _chunk(self, chunk: _Chunk, sse: SSEEvent) -> list[Action]:
        raw_usage = chunk.usage or (chunk.x_groq.usage if chunk.x_groq else None)
        usage = _usage(raw_usage) if raw_usage is not None else None
        # A failing chunk's usage rides on the Fail: a router reports what the failed call is billed
        # beside the error, and nothing after the Fail reaches the stream.
        if chunk.error or sse.event == "error":
            return [self._fail(chunk.error if chunk.error else chunk, usage)]
        if chunk.object == "error":
            return [self._fail(chunk, usage)]
        out: list[Action] = []
        for position, choice in enumerate(chunk.choices or ()):
            index = choice.index if choice.index is not None else position
            if index != 0:
                out.append(Ignore(f"choices[{index}]"))
                continue
            out += self._choice(choice, usage)
            if out and isinstance(out[-1], Fail):
                return out
        if usage is not None:
            out.append(SetUsage(usage))
        if not out and chunk.choices is None and chunk.prompt_filter_results is None:
            # Neither a chunk nor a usage report: something this dialect does not know yet.
            out.append(Ignore(chunk.object or "chunk without choices"))
        return out

    def _choice(self, choice: _Choice, usage: Usage | None) -> list[Action]:
        out: list[Action] = []
        d = choice.delta
        if d is not None:
            reasoning = d.reasoning_content or d.reasoning
            if reasoning:
                out += self._sequential_fragment("reasoning", reasoning)
            if isinstance(d.content, str):
                if d.content:
                    out += self._sequential_fragment("text", d.content)
            elif d.content is not None:
                out += self._content_parts(d.content)
            if d.refusal:
                out += self._sequential_fragment("refusal", d.refusal)
            for position, call in enumerate(d.tool_calls or ()):
                out += self._tool_fragment(call, position)
            if d.function_call is not None:
                out += self._tool_fragment(
                    _ToolCall(index=_FUNCTION_CALL_INDEX, function=d.function_call), _FUNCTION_CALL_INDEX
                )
        if choice.error:
            out.append(self._fail(choice.error, usage))
        elif choice.finish_reason in self.FAILURE_FINISH_REASONS:
            reason = choice.finish_reason
            out.append(
                Fail(
                    category=self.FAILURE_FINISH_REASONS[reason],
                    provider_code=reason,
                    message=f"the provider ended the turn with finish_reason {reason!r}",
                    usage=usage,
                )
            )
        elif choice.finish_reason is not None:
            self._finish_reason = choice.finish_reason
        return out

    def _content_parts(self, content: Any) -> list[Action]:
        """A typed-part ``delta.content``, part by part in wire order: ``thinking`` parts are reasoning
        fragments, ``text`` parts text fragments (Mistral streams reasoning as lists, and the answer as
        lists or plain strings); any other part type is counted and skipped."""
        try:
            parts = msgspec.convert(content, list[_ContentPart])
        except msgspec.ValidationError:
            return [Ignore("non-string delta.content")]
        out: list[Action] = []
        for part in parts:
            if part.type == "text":
                if part.text:
                    out += self._sequential_fragment("text", part.text)
            elif part.type == "thinking":
                inner = (
                    [_ContentPart(type="text", text=part.thinking)] if isinstance(part.thinking, str) else part.thinking
                )
                for sub in inner or ():
                    if sub.type != "text":
                        out.append(Ignore(f"delta.content thinking part {sub.type or '?'}"))
                    elif sub.text:
                        out += self._sequential_fragment("reasoning", sub.text)
            else:
                out.append(Ignore(f"delta.content part {part.type or '?'}"))
        return out

    def _fail(self, err: Any, usage: Usage | None) -> Fail:
        if isinstance(err, _Chunk):
            code, type_, message = as_str(err.code), as_str(err.type), err.message
        elif isinstance(err, dict):
            code, type_, message = as_str(err.get("code")), as_str(err.get("type")), err.get("message")
        else:  # a bare string or number: the message is all there is
            code, type_, message = None, None, err if isinstance(err, str) else None
        return Fail(
            category=self.error_category(code, type_),
            provider_code=code if code is not None else type_,
            message=safe_message(message, "the provider reported an error in the stream"),
            usage=usage,
        )

    # -- blocks -----------------------------------------------------------------------------------

    def _open_key(self, kind: BlockKind) -> tuple[BlockKind, int]:
        key = (kind, self._serial)
        self._serial += 1
        self._open[key] = None
        return key

    def _close(self, key: tuple[BlockKind, int]) -> Close:
        del self._open[key]
        return Close(key)

    def _close_sequential(self) -> list[Action]:
        if self._sequential is None:
            return []
        key, self._sequential = self._sequential, None
        return [self._close(key)]

    def _close_tools(self) -> list[Action]:
        out: list[Action] = []
        for tool in self._tools.values():
            if tool.call_id:
                self._closed_call_ids.add(tool.call_id)
            out.append(self._close(tool.key))
        self._tools.clear()
        return out

    def _sequential_fragment(self, kind: BlockKind, text: str) -> list[Action]:
        out: list[Action] = []
        if self._sequential is None or self._sequential[0] != kind:
            out += self._close_sequential()
            out += self._close_tools()
            self._sequential = self._open_key(kind)
            out.append(Open(self._sequential, kind))
        out.append(Append(self._sequential, "text", text))
        return out

    def _tool_fragment(self, call: _ToolCall, position: int) -> list[Action]:
        if call.type not in (None, "function"):
            return [Ignore(f"tool_call type {call.type}")]
        index = call.index if call.index is not None else position
        fn = call.function or _Function()
        call_id, name, args = call.id or None, fn.name or None, _arguments_text(fn.arguments)
        out: list[Action] = self._close_sequential()
        tool = self._tools.get(index)
        if tool is not None and call_id is not None and call_id != tool.call_id:
            # Same index, another id: a new call. Concatenating would merge two calls' JSON.
            if tool.call_id:
                self._closed_call_ids.add(tool.call_id)
            out.append(self._close(tool.key))
            tool = None
            del self._tools[index]
        if tool is None:
            if call_id is None and name is None:
                if args:
                    raise ProviderProtocolError(
                        f"tool-call arguments for index {index}, which has no open call (no id, no name)"
                    )
                return out
            if call_id is not None and call_id in self._closed_call_ids:
                raise ProviderProtocolError(f"tool call {call_id!r} continued after it was closed")
            tool = self._tools[index] = _OpenTool(self._open_key("tool_call"), call_id)
            out.append(Open(tool.key, "tool_call", name=name, call_id=call_id))
        if args:
            out.append(Append(tool.key, "json_text", args))
        return out

    def _done(self) -> list[Action]:
        out: list[Action] = [] if self._started else [Start()]
        self._started = True
        out += [self._close(key) for key in list(self._open)]
        self._sequential = None
        self._tools.clear()
        reason = self._finish_reason
        out.append(Finish(stop_reason=self.stop_reason(reason), provider_stop_reason=reason))
        return out

"""OpenAI Chat Completions requests: ``POST /v1/chat/completions``, streaming with usage.

Rule: one ``GenerateRequest`` becomes the body OpenAI documents
(https://platform.openai.com/docs/api-reference/chat/create), which OpenAI-compatible servers read too:

- ``system`` is the first message, role ``system`` (compatible servers know no ``developer`` role; OpenAI
  treats ``system`` as ``developer`` for its reasoning models);
- string content stays a string; text parts become a content array of ``{"type": "text"}`` parts;
- an assistant's tool calls become ``tool_calls`` ``[{id, type: function, function: {name, arguments}}]``
  with ``arguments`` a JSON *string*; ``content`` is null when the message has no text;
- each ``tool_result`` becomes its own role ``tool`` message with ``tool_call_id``; Chat Completions
  has no error flag, so ``is_error`` is not sent (the content says what went wrong);
- ``tool_choice``: ``"auto" | "none" | "required"`` or ``{"type": "function", "function": {"name"}}``;
  sent only with tools (OpenAI rejects ``tool_choice`` without ``tools``; without tools "none" and
  "auto" mean the same anyway);
- ``max_tokens`` is sent as ``max_completion_tokens``: OpenAI deprecated ``max_tokens`` and its
  reasoning models reject it. Servers that read only ``max_tokens`` (Ollama, LM Studio: they ignore the
  new name silently) need the builder option ``max_tokens_field="max_tokens"`` (from route config);
- ``reasoning.effort`` becomes ``reasoning_effort``; ``budget_tokens`` alone has no equivalent and is
  refused rather than guessed; ``include_encrypted`` asks for nothing (no reasoning comes back to replay);
- Chat Completions has no place for earlier reasoning: ``reasoning`` parts are left out with a warning
  (and an assistant message left with nothing, with another);
- ``response_format`` is ``response_format: {"type": "json_schema", json_schema: {name, description?, schema,
  strict}}`` (Structured Outputs);
- ``stream: true`` and ``stream_options.include_usage: true`` (the usage chunk the adapter reads); servers
  that refuse the field (Cohere's compatibility endpoint) need the builder option
  ``stream_options="omit"`` (from route config), and their usage may then be absent;
- sluice normalizes a single choice, so ``extra`` asking for ``n`` > 1 is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.normalizer.requests.auth import auth_header
from sluice.normalizer.requests.base import ProviderRequest, assemble, json_text, require_model
from sluice.schemas.errors import ConfigError
from sluice.schemas.request import (
    GenerateRequest,
    InvalidRequest,
    Message,
    NamedToolChoice,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)

__all__ = ["DIALECT", "OPTIONS", "PATH", "build"]

DIALECT = "openai-chat"
PATH = "/v1/chat/completions"
OPTIONS: frozenset[str] = frozenset({"max_tokens_field", "stream_options"})
_MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")
_STREAM_OPTIONS = ("include_usage", "omit")


def build(
    req: GenerateRequest,
    *,
    model: str,
    api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
    max_tokens_field: str = "max_completion_tokens",
    stream_options: str = "include_usage",
) -> ProviderRequest:
    """Raises ``InvalidRequest`` and ``ConfigError``."""
    if max_tokens_field not in _MAX_TOKENS_FIELDS:
        raise ConfigError(f"{DIALECT}: max_tokens_field must be one of {', '.join(_MAX_TOKENS_FIELDS)}")
    if stream_options not in _STREAM_OPTIONS:
        raise ConfigError(f"{DIALECT}: stream_options must be one of {', '.join(_STREAM_OPTIONS)}")
    if req.extra.get("n") not in (None, 1):
        raise InvalidRequest(f"{DIALECT}: n > 1 is not supported; sluice normalizes one choice")
    warnings: list[str] = []
    body: dict[str, Any] = {"model": require_model(model), "messages": _messages(req, warnings)}
    if req.tools:
        body["tools"] = [_tool(tool) for tool in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.max_tokens is not None:
        body[max_tokens_field] = req.max_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.stop:
        body["stop"] = list(req.stop)
    if req.reasoning is not None:
        if req.reasoning.effort is not None:
            body["reasoning_effort"] = req.reasoning.effort
        elif req.reasoning.budget_tokens is not None:
            raise InvalidRequest(f"{DIALECT} takes reasoning.effort; budget_tokens alone has no equivalent")
    if req.response_format is not None:
        fmt = req.response_format
        spec: dict[str, Any] = {"name": fmt.name}
        if fmt.description:
            spec["description"] = fmt.description
        spec |= {"schema": fmt.schema, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    body["stream"] = True
    if stream_options == "include_usage":
        body["stream_options"] = {"include_usage": True}
    auth = auth_header("bearer", api_key)
    return assemble(
        dialect=DIALECT,
        path=PATH,
        auth=auth,
        headers={},
        body=body,
        req=req,
        extra_headers=extra_headers,
        warnings=warnings,
    )


def _messages(req: GenerateRequest, warnings: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": req.system})
    for index, message in enumerate(req.messages):
        if not isinstance(message.content, str) and any(isinstance(p, ReasoningPart) for p in message.content):
            warnings.append(f"messages[{index}]: reasoning left out ({DIALECT} has no place for it)")
            if all(isinstance(p, ReasoningPart) for p in message.content):
                warnings.append(f"messages[{index}]: left out, nothing in it is for {DIALECT}")
                continue
        out.extend(_message(message))
    return out


def _message(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "tool":
        return [
            {"role": "tool", "tool_call_id": part.call_id, "content": part.content}
            for part in message.content
            if isinstance(part, ToolResultPart)
        ]
    texts = [{"type": "text", "text": part.text} for part in message.content if isinstance(part, TextPart)]
    if message.role == "user":
        return [{"role": "user", "content": texts}]
    calls = [
        {
            "id": part.call_id,
            "type": "function",
            "function": {"name": part.name, "arguments": json_text(part.arguments)},
        }
        for part in message.content
        if isinstance(part, ToolCallPart)
    ]
    out: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if calls:
        out["tool_calls"] = calls
    return [out]


def _tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> Any:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice

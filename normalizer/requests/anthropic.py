"""Anthropic Messages requests: ``POST /v1/messages``, streaming.

Rule: one ``GenerateRequest`` becomes the body Anthropic documents
(https://docs.anthropic.com/en/api/messages), with ``x-api-key`` and ``anthropic-version: 2023-06-01``:

- ``system`` is the top-level ``system`` string;
- string content stays a string; parts become content blocks: ``{"type": "text", text}``, and an
  assistant's ``tool_call`` is ``{"type": "tool_use", id, name, input}``;
- Anthropic has no tool role: tool results are ``{"type": "tool_result", tool_use_id, content,
  is_error}`` blocks in a *user* message, and consecutive tool messages are merged into one user message
  (every result of a turn's parallel calls must come back together, in the message right after it);
- tools are ``{name, description, input_schema}``;
- ``tool_choice``: auto -> ``{"type": "auto"}``, required -> ``{"type": "any"}``, a named tool ->
  ``{"type": "tool", name}``, none -> ``{"type": "none"}``; only with tools;
- ``max_tokens`` is required by Anthropic: when the job gives none it is 4096, or the thinking budget
  plus 4096 when that budget is larger (Anthropic requires ``budget_tokens < max_tokens``);
- ``stop`` is ``stop_sequences``;
- ``reasoning`` is ``thinking: {"type": "enabled", budget_tokens}``, the budget from ``budget_tokens`` or
  the effort (``EFFORT_BUDGETS``); ``budget_tokens: 0`` sends no thinking (off is Anthropic's default);
- an assistant's ``reasoning`` part made by Anthropic goes back as it came, in its place among the blocks
  (Anthropic needs a tool-use turn's thinking back, signed): ``{"type": "thinking", thinking, signature}``,
  or ``{"type": "redacted_thinking", data}`` for an encrypted one. A part from another dialect, or thinking
  without its signature (Anthropic refuses it), is left out with a warning; an assistant message left
  with nothing is left out too (Anthropic refuses empty content);
- ``response_format`` is ``output_config: {format: {"type": "json_schema", schema}}`` (structured outputs;
  Anthropic's format has no name, description or strict switch);
- ``stream: true``.

Claude on Vertex AI (the builder option ``vertex = "true"``, which the worker's route decides): the same
body without ``model`` (the model is in the path, ``VERTEX_PATH`` by default: ``:streamRawPredict``) and
with ``anthropic_version: "vertex-2023-10-16"`` in place of the ``anthropic-version`` header
(https://cloud.google.com/vertex-ai/generative-ai/docs/partner-models/claude/use-claude).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.normalizer.requests.auth import auth_header
from sluice.normalizer.requests.base import ProviderRequest, assemble, reasoning_for, require_model, thinking_budget
from sluice.schemas.errors import ConfigError
from sluice.schemas.request import (
    GenerateRequest,
    Message,
    NamedToolChoice,
    Part,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "DIALECT",
    "OPTIONS",
    "PATH",
    "VERTEX_PATH",
    "VERTEX_VERSION",
    "build",
    "default_path",
]

DIALECT = "anthropic"
PATH = "/v1/messages"
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
OPTIONS: frozenset[str] = frozenset({"vertex"})
VERTEX_VERSION = "vertex-2023-10-16"
VERTEX_PATH = "/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict"
_FLAGS: Mapping[str, bool] = {"true": True, "false": False}

_TOOL_CHOICE: Mapping[str, str] = {"auto": "auto", "required": "any", "none": "none"}


def build(
    req: GenerateRequest,
    *,
    model: str,
    api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
    vertex: str = "false",
) -> ProviderRequest:
    """Raises ``InvalidRequest`` and ``ConfigError``."""
    on_vertex = _vertex(vertex)
    budget = thinking_budget(req.reasoning)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if not budget or budget < DEFAULT_MAX_TOKENS else budget + DEFAULT_MAX_TOKENS
    body: dict[str, Any] = {"model": require_model(model), "max_tokens": max_tokens}
    if req.system:
        body["system"] = req.system
    warnings: list[str] = []
    body["messages"] = _messages(req.messages, warnings)
    if req.tools:
        body["tools"] = [_tool(tool) for tool in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.stop:
        body["stop_sequences"] = list(req.stop)
    if budget:
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    if req.response_format is not None:
        body["output_config"] = {"format": {"type": "json_schema", "schema": req.response_format.schema}}
    body["stream"] = True
    headers = {"anthropic-version": ANTHROPIC_VERSION}
    if on_vertex:
        del body["model"]
        body = {"anthropic_version": VERTEX_VERSION, **body}
        headers = {}
    return assemble(
        dialect=DIALECT,
        path=PATH,
        auth=auth_header("x-api-key", api_key),
        headers=headers,
        body=body,
        req=req,
        extra_headers=extra_headers,
        warnings=warnings,
    )


def _vertex(value: str) -> bool:
    flag = _FLAGS.get(value)
    if flag is None:
        raise ConfigError(f'{DIALECT}: request option vertex must be "true" or "false", not {value!r}')
    return flag


def default_path(options: Mapping[str, str]) -> str | None:
    """The path template a route with these options posts to, when it names none (None: ``PATH``)."""
    return VERTEX_PATH if _vertex(options.get("vertex", "false")) else None


def _messages(messages: list[Message], warnings: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous_role: str | None = None
    for index, message in enumerate(messages):
        if message.role == "tool":
            results = [_tool_result(part) for part in message.content if isinstance(part, ToolResultPart)]
            if previous_role == "tool":
                out[-1]["content"].extend(results)
            else:
                out.append({"role": "user", "content": results})
        elif isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        else:
            blocks = [block for part in message.content if (block := _block(part, index, warnings)) is not None]
            if not blocks:
                warnings.append(f"messages[{index}]: left out, nothing in it is for {DIALECT}")
                continue
            out.append({"role": message.role, "content": blocks})
        previous_role = message.role
    return out


def _block(part: Part, index: int, warnings: list[str]) -> dict[str, Any] | None:
    if isinstance(part, ToolCallPart):
        return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": part.arguments}
    if isinstance(part, ReasoningPart):
        own = reasoning_for(DIALECT, part, index, warnings)
        if own is None:
            return None
        if own.encrypted:
            return {"type": "redacted_thinking", "data": own.encrypted}
        if own.signature:
            return {"type": "thinking", "thinking": own.text, "signature": own.signature}
        warnings.append(f"messages[{index}]: thinking without its signature left out (Anthropic refuses it)")
        return None
    assert isinstance(part, TextPart)  # user and assistant messages carry no tool results
    return {"type": "text", "text": part.text}


def _tool_result(part: ToolResultPart) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": part.call_id, "content": part.content, "is_error": part.is_error}


def _tool(tool: Tool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["input_schema"] = tool.parameters
    return out


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    if isinstance(choice, NamedToolChoice):
        return {"type": "tool", "name": choice.name}
    return {"type": _TOOL_CHOICE[choice]}

"""OpenAI Responses requests: ``POST /v1/responses``, streaming.

Rule: one ``GenerateRequest`` becomes the body OpenAI documents
(https://platform.openai.com/docs/api-reference/responses/create), conversation order kept item by item:

- ``system`` is ``instructions``;
- messages are ``{"type": "message", role, content}`` input items. String content stays a string. User
  text parts become ``input_text`` content parts. Each assistant text part becomes its own assistant
  message with string content: the "easy" input message, the one form the API types accept for
  assistant text without the ``id`` and ``status`` an output message item would need;
- a ``tool_call`` part is a ``function_call`` item ``{call_id, name, arguments}`` (arguments a JSON
  string), a ``tool_result`` a ``function_call_output`` item ``{call_id, output}``; the Responses API has
  no error flag, so ``is_error`` is not sent;
- tools are ``{"type": "function", name, description, parameters, "strict": false}``: Responses
  defaults ``strict`` to true and then rewrites the schema (every property required, no additional
  properties), so sluice asks for the schema as given, like Chat Completions does by default;
- ``tool_choice``: ``"auto" | "none" | "required"`` or ``{"type": "function", "name"}``, only with tools;
- ``max_tokens`` is ``max_output_tokens``; ``reasoning.effort`` is ``reasoning: {effort}`` (``budget_tokens``
  alone has no equivalent and is refused; reasoning summaries are off unless ``extra`` asks, e.g.
  ``{"reasoning": {"summary": "auto"}}``, which merges into the same object);
  ``reasoning.include_encrypted`` is ``include: ["reasoning.encrypted_content"]``;
- an assistant's ``reasoning`` part made by this dialect is a ``reasoning`` input item ``{summary,
  content?, encrypted_content}``, in its place: stateless, without the ``rs_`` id, which would make the
  API look the stored item up and demand the items that followed it by id. A part without encrypted
  content cannot be replayed that way and one from another dialect means nothing here: both are left
  out with a warning;
- ``response_format`` is ``text: {format: {"type": "json_schema", name, description?, schema, strict}}``;
- ``stop`` does not exist in the Responses API: a request with stop sequences is refused, because
  silently generating past a stop the caller relies on would be worse than failing;
- ``stream: true``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.normalizer.requests.auth import auth_header
from sluice.normalizer.requests.base import ProviderRequest, assemble, json_text, reasoning_for, require_model
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

DIALECT = "openai-responses"
PATH = "/v1/responses"
OPTIONS: frozenset[str] = frozenset()


def build(
    req: GenerateRequest,
    *,
    model: str,
    api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
) -> ProviderRequest:
    """Raises ``InvalidRequest`` and ``ConfigError``."""
    if req.stop:
        raise InvalidRequest(f"{DIALECT} has no stop sequences; remove stop or use another route")
    body: dict[str, Any] = {"model": require_model(model)}
    if req.system:
        body["instructions"] = req.system
    warnings: list[str] = []
    body["input"] = [item for index, message in enumerate(req.messages) for item in _items(message, index, warnings)]
    if req.tools:
        body["tools"] = [_tool(tool) for tool in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.max_tokens is not None:
        body["max_output_tokens"] = req.max_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.reasoning is not None:
        if req.reasoning.effort is not None:
            body["reasoning"] = {"effort": req.reasoning.effort}
        elif req.reasoning.budget_tokens is not None:
            raise InvalidRequest(f"{DIALECT} takes reasoning.effort; budget_tokens alone has no equivalent")
        if req.reasoning.include_encrypted:
            body["include"] = ["reasoning.encrypted_content"]
    if req.response_format is not None:
        fmt = req.response_format
        spec: dict[str, Any] = {"type": "json_schema", "name": fmt.name}
        if fmt.description:
            spec["description"] = fmt.description
        body["text"] = {"format": spec | {"schema": fmt.schema, "strict": fmt.strict}}
    body["stream"] = True
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


def _items(message: Message, index: int, warnings: list[str]) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"type": "message", "role": message.role, "content": message.content}]
    if message.role == "user":
        content = [{"type": "input_text", "text": part.text} for part in message.content if isinstance(part, TextPart)]
        return [{"type": "message", "role": "user", "content": content}]
    items: list[dict[str, Any]] = []
    for part in message.content:
        if isinstance(part, TextPart):
            items.append({"type": "message", "role": "assistant", "content": part.text})
        elif isinstance(part, ToolCallPart):
            items.append(
                {
                    "type": "function_call",
                    "call_id": part.call_id,
                    "name": part.name,
                    "arguments": json_text(part.arguments),
                }
            )
        elif isinstance(part, ReasoningPart):
            item = _reasoning_item(part, index, warnings)
            if item is not None:
                items.append(item)
        else:
            assert isinstance(part, ToolResultPart)
            items.append({"type": "function_call_output", "call_id": part.call_id, "output": part.content})
    return items


def _reasoning_item(part: ReasoningPart, index: int, warnings: list[str]) -> dict[str, Any] | None:
    own = reasoning_for(DIALECT, part, index, warnings)
    if own is None:
        return None
    if not own.encrypted:
        warnings.append(
            f"messages[{index}]: a reasoning item without its encrypted content left out "
            "(ask for it with reasoning.include_encrypted)"
        )
        return None
    item: dict[str, Any] = {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in own.summary]}
    if own.text:
        item["content"] = [{"type": "reasoning_text", "text": own.text}]
    item["encrypted_content"] = own.encrypted
    return item


def _tool(tool: Tool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    out["strict"] = False
    return out


def _tool_choice(choice: ToolChoice) -> Any:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "name": choice.name}
    return choice

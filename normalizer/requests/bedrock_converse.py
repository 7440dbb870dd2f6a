"""AWS Bedrock Converse requests: ``POST /model/{model}/converse-stream``, answered in AWS event-stream.

Rule: one ``GenerateRequest`` becomes the body the Converse API documents
(https://docs.aws.amazon.com/bedrock/latest/APIReference/API_runtime_ConverseStream.html); the model id
(an ARN or an inference profile id included) is percent-encoded whole into the path. The credential is a
Bedrock API key as ``authorization: Bearer`` when ``api_key`` is given; otherwise the request goes unsigned
from here and the route's SigV4 credential signs it (``auth = "aws-sigv4"``).

- ``system`` is ``system: [{"text": ...}]``;
- every message's content is a list of content blocks: ``{"text"}``; an assistant's ``tool_call`` is
  ``{"toolUse": {toolUseId, name, input}}``; tool results are ``{"toolResult": {toolUseId, content:
  [{"text"}], status}}`` blocks in a *user* message, consecutive tool messages merged into one (as
  Anthropic, whose models Bedrock mostly serves);
- tools are ``toolConfig.tools[].toolSpec {name, description, inputSchema: {json}}``; ``tool_choice``:
  auto -> ``{"auto": {}}``, required -> ``{"any": {}}``, a named tool -> ``{"tool": {name}}``; ``none``
  cannot be expressed (Converse has no such choice): the tools are sent and a warning says so;
- ``inferenceConfig``: ``maxTokens``, ``temperature``, ``topP``, ``stopSequences``;
- ``response_format`` is ``outputConfig.textFormat: {"type": "json_schema", structure: {jsonSchema: {schema,
  name, description?}}}``, the schema as a JSON *string* (Converse's type for it);
- ``reasoning`` is ``additionalModelRequestFields.thinking {"type": "enabled", budget_tokens}`` (the form
  Bedrock documents for Claude models; the budget from ``budget_tokens`` or the effort); other model
  families take other fields, which ``extra`` can set;
- an assistant's ``reasoning`` part made by this dialect goes back in its place as ``{"reasoningContent":
  {"reasoningText": {text, signature}}}``, or ``{"reasoningContent": {"redactedContent"}}`` for an
  encrypted one; one from another dialect, or text without a signature, is left out with a warning, and
  an assistant message left with nothing is left out too (Bedrock refuses empty content), as is an empty
  text block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from sluice.normalizer.requests.base import (
    ProviderRequest,
    assemble,
    json_text,
    reasoning_for,
    require_model,
    thinking_budget,
)
from sluice.schemas.request import (
    GenerateRequest,
    Message,
    NamedToolChoice,
    Part,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolResultPart,
)

__all__ = ["DIALECT", "OPTIONS", "PATH", "build"]

DIALECT = "bedrock-converse"
PATH = "/model/{model}/converse-stream"
OPTIONS: frozenset[str] = frozenset()

_TOOL_CHOICE: Mapping[str, dict[str, Any]] = {"auto": {"auto": {}}, "required": {"any": {}}}


def build(
    req: GenerateRequest,
    *,
    model: str,
    api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
) -> ProviderRequest:
    """Raises ``InvalidRequest`` and ``ConfigError``."""
    path = PATH.format(model=quote(require_model(model), safe=""))
    warnings: list[str] = []
    body: dict[str, Any] = {"messages": _messages(req.messages, warnings)}
    if req.system:
        body["system"] = [{"text": req.system}]
    inference: dict[str, Any] = {}
    if req.max_tokens is not None:
        inference["maxTokens"] = req.max_tokens
    if req.temperature is not None:
        inference["temperature"] = req.temperature
    if req.top_p is not None:
        inference["topP"] = req.top_p
    if req.stop:
        inference["stopSequences"] = list(req.stop)
    if inference:
        body["inferenceConfig"] = inference
    if req.tools:
        config: dict[str, Any] = {"tools": [_tool(tool) for tool in req.tools]}
        choice = req.tool_choice
        if isinstance(choice, NamedToolChoice):
            config["toolChoice"] = {"tool": {"name": choice.name}}
        elif choice == "none":
            warnings.append(
                "tool_choice none cannot be expressed in Converse: the tools are sent, the model may call them"
            )
        elif choice is not None:
            config["toolChoice"] = _TOOL_CHOICE[choice]
        body["toolConfig"] = config
    if req.response_format is not None:
        fmt = req.response_format
        definition: dict[str, Any] = {"schema": json_text(fmt.schema), "name": fmt.name}
        if fmt.description:
            definition["description"] = fmt.description
        body["outputConfig"] = {"textFormat": {"type": "json_schema", "structure": {"jsonSchema": definition}}}
    budget = thinking_budget(req.reasoning)
    if budget:
        body["additionalModelRequestFields"] = {"thinking": {"type": "enabled", "budget_tokens": budget}}
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return assemble(
        dialect=DIALECT,
        path=path,
        auth=auth,
        headers={"accept": "application/vnd.amazon.eventstream"},
        body=body,
        req=req,
        extra_headers=extra_headers,
        warnings=warnings,
    )


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
            previous_role = message.role
            continue
        parts: list[Part] = [TextPart(text=message.content)] if isinstance(message.content, str) else message.content
        blocks = [block for part in parts if (block := _block(part, index, warnings)) is not None]
        if not blocks:
            warnings.append(f"messages[{index}]: left out, nothing in it is for {DIALECT}")
            continue
        out.append({"role": message.role, "content": blocks})
        previous_role = message.role
    return out


def _block(part: Part, index: int, warnings: list[str]) -> dict[str, Any] | None:
    if isinstance(part, ToolCallPart):
        return {"toolUse": {"toolUseId": part.call_id, "name": part.name, "input": part.arguments}}
    if isinstance(part, ReasoningPart):
        own = reasoning_for(DIALECT, part, index, warnings)
        if own is None:
            return None
        if own.encrypted:
            return {"reasoningContent": {"redactedContent": own.encrypted}}
        if own.signature:
            return {"reasoningContent": {"reasoningText": {"text": own.text, "signature": own.signature}}}
        warnings.append(f"messages[{index}]: reasoning without its signature left out (Bedrock refuses it)")
        return None
    assert isinstance(part, TextPart)  # user and assistant messages carry no tool results
    return {"text": part.text} if part.text else None


def _tool_result(part: ToolResultPart) -> dict[str, Any]:
    status = "error" if part.is_error else "success"
    return {"toolResult": {"toolUseId": part.call_id, "content": [{"text": part.content}], "status": status}}


def _tool(tool: Tool) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": tool.name}
    if tool.description:
        spec["description"] = tool.description
    spec["inputSchema"] = {"json": tool.parameters}
    return {"toolSpec": spec}

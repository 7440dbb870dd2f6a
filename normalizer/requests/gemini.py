"""Gemini requests: ``POST /v1beta/models/{model}:streamGenerateContent?alt=sse``.

Rule: one ``GenerateRequest`` becomes the ``GenerateContentRequest`` Google documents
(https://ai.google.dev/api/generate-content), with the key in ``x-goog-api-key`` and the model in the
URL path (``models/`` prefix accepted and stripped; only plain model names, so a job's model can never
steer the path elsewhere). Streaming is the path's method plus ``alt=sse``; the body has no stream flag.

- ``system`` is ``systemInstruction: {parts: [{text}]}``;
- roles: user -> ``user``, assistant -> ``model``; text is a ``{text}`` part; an assistant's tool call is
  ``{functionCall: {name, args}}`` (args an object), with its ``signature`` as the part's
  ``thoughtSignature`` when the job kept one (Gemini 3 refuses function calls replayed without it); an
  assistant text part's ``signature`` is its ``thoughtSignature`` too;
- an assistant's ``reasoning`` part made by Gemini is a thought part ``{text, thought: true,
  thoughtSignature?}`` in its place; one from another dialect is left out with a warning (as is an
  assistant message left with nothing: Gemini refuses a turn without parts);
- tool results go back in a ``user`` turn as ``{functionResponse: {name, response}}``; Gemini matches a
  response to its call by function *name*, resolved here from the earlier tool call with the same call
  id; ``response`` is ``{"output": content}``, or ``{"error": content}`` when ``is_error`` (the keys
  Google documents for a function's output and its error). Consecutive tool messages become one turn:
  a turn's parallel calls are answered together;
- tools are one ``{functionDeclarations: [{name, description, parametersJsonSchema}]}``: the shape's
  parameters are JSON Schema, which ``parametersJsonSchema`` takes as is (``parameters`` takes Google's
  OpenAPI subset and rejects some JSON Schema keywords);
- ``tool_choice`` is ``toolConfig.functionCallingConfig``: auto -> AUTO, none -> NONE, required -> ANY,
  a named tool -> ANY with ``allowedFunctionNames: [name]``; only with tools;
- ``response_format`` is ``generationConfig.responseMimeType: "application/json"`` with
  ``responseJsonSchema`` (JSON Schema as given; ``responseSchema`` takes Google's OpenAPI subset);
- ``generationConfig``: ``maxOutputTokens``, ``temperature``, ``topP``, ``stopSequences``, and for
  ``reasoning`` ``thinkingConfig: {thinkingBudget, includeThoughts: true}`` (the budget from
  ``budget_tokens`` or the effort, ``EFFORT_BUDGETS``; ``budget_tokens: 0`` is ``thinkingBudget: 0``,
  thinking off, without thoughts); omitted when empty;
- sluice normalizes a single candidate, so ``extra`` asking for ``candidateCount`` > 1 is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.normalizer.requests.auth import auth_header
from sluice.normalizer.requests.base import ProviderRequest, assemble, reasoning_for, thinking_budget
from sluice.normalizer.requests.paths import model_segment
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

__all__ = ["DIALECT", "OPTIONS", "PATH_TEMPLATE", "build", "path_for"]

DIALECT = "gemini"
PATH_TEMPLATE = "/v1beta/models/{model}:streamGenerateContent?alt=sse"
OPTIONS: frozenset[str] = frozenset()

_MODES: Mapping[str, str] = {"auto": "AUTO", "none": "NONE", "required": "ANY"}


def path_for(model: str) -> str:
    """The streaming path for a model. Raises ``InvalidRequest`` for a name that is not a plain name."""
    return PATH_TEMPLATE.format(model=model_segment(model, DIALECT))


def build(
    req: GenerateRequest,
    *,
    model: str,
    api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
) -> ProviderRequest:
    """Raises ``InvalidRequest`` and ``ConfigError``."""
    path = path_for(model)
    config = req.extra.get("generationConfig")
    if isinstance(config, dict) and config.get("candidateCount") not in (None, 1):
        raise InvalidRequest(f"{DIALECT}: candidateCount > 1 is not supported; sluice normalizes one candidate")
    body: dict[str, Any] = {}
    if req.system:
        body["systemInstruction"] = {"parts": [{"text": req.system}]}
    warnings: list[str] = []
    body["contents"] = _contents(req.messages, warnings)
    if req.tools:
        body["tools"] = [{"functionDeclarations": [_declaration(tool) for tool in req.tools]}]
        if req.tool_choice is not None:
            body["toolConfig"] = {"functionCallingConfig": _calling_config(req.tool_choice)}
    generation = _generation_config(req)
    if generation:
        body["generationConfig"] = generation
    auth = auth_header("x-goog-api-key", api_key)
    return assemble(
        dialect=DIALECT,
        path=path,
        auth=auth,
        headers={},
        body=body,
        req=req,
        extra_headers=extra_headers,
        warnings=warnings,
    )


def _contents(messages: list[Message], warnings: list[str]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}  # call id -> function name, from the calls seen so far
    out: list[dict[str, Any]] = []
    previous_role: str | None = None
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            role = "model" if message.role == "assistant" else "user"
            out.append({"role": role, "parts": [{"text": message.content}]})
        elif message.role == "tool":
            responses = [
                _function_response(part, names[part.call_id])
                for part in message.content
                if isinstance(part, ToolResultPart)
            ]
            if previous_role == "tool":
                out[-1]["parts"].extend(responses)
            else:
                out.append({"role": "user", "parts": responses})
        else:
            parts: list[dict[str, Any]] = []
            for part in message.content:
                if isinstance(part, ToolCallPart):
                    names[part.call_id] = part.name
                    call: dict[str, Any] = {"functionCall": {"name": part.name, "args": part.arguments}}
                    if part.signature is not None:
                        call["thoughtSignature"] = part.signature
                    parts.append(call)
                elif isinstance(part, ReasoningPart):
                    own = reasoning_for(DIALECT, part, index, warnings)
                    if own is not None:
                        parts.append(_signed({"text": own.text, "thought": True}, own.signature))
                else:
                    assert isinstance(part, TextPart)  # user and assistant messages carry no tool results
                    parts.append(_signed({"text": part.text}, part.signature))
            if not parts:
                warnings.append(f"messages[{index}]: left out, nothing in it is for {DIALECT}")
                continue
            out.append({"role": "model" if message.role == "assistant" else "user", "parts": parts})
        previous_role = message.role
    return out


def _signed(part: dict[str, Any], signature: str | None) -> dict[str, Any]:
    if signature is not None:
        part["thoughtSignature"] = signature
    return part


def _function_response(part: ToolResultPart, name: str) -> dict[str, Any]:
    key = "error" if part.is_error else "output"
    return {"functionResponse": {"name": name, "response": {key: part.content}}}


def _declaration(tool: Tool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parametersJsonSchema"] = tool.parameters
    return out


def _calling_config(choice: ToolChoice) -> dict[str, Any]:
    if isinstance(choice, NamedToolChoice):
        return {"mode": "ANY", "allowedFunctionNames": [choice.name]}
    return {"mode": _MODES[choice]}


def _generation_config(req: GenerateRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req.max_tokens is not None:
        out["maxOutputTokens"] = req.max_tokens
    if req.temperature is not None:
        out["temperature"] = req.temperature
    if req.top_p is not None:
        out["topP"] = req.top_p
    if req.stop:
        out["stopSequences"] = list(req.stop)
    budget = thinking_budget(req.reasoning)
    if budget is not None:
        out["thinkingConfig"] = {"thinkingBudget": budget, "includeThoughts": True} if budget else {"thinkingBudget": 0}
    if req.response_format is not None:
        out["responseMimeType"] = "application/json"
        out["responseJsonSchema"] = req.response_format.schema
    return out

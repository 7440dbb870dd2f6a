"""What a request's output is checked against (contract 1.3): the declarations its tool calls and its
structured answer are held to, as the status record's ``checks`` field keeps them for ``sluice audit``.

Rule: derived from the request alone (``checks_for``): its tools (name -> the JSON Schema of the
arguments) when it declares any or sets a ``tool_choice``, its ``tool_choice``, and its answer's JSON Schema
when it asks for one. A request that declares neither has nothing to check (``None``) and its attempts carry
no verdict. Tools a job sends only in ``extra`` (a provider's native form, its server-side tools) are not
declarations: a call the provider streams as a tool call is checked against ``request.tools`` alone. The
policy is not part of the spec: it belongs to each attempt (its route's, or the job's override), and the
attempt's ``stream.start`` names it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sluice.schemas.request import GenerateRequest, ToolChoice

__all__ = ["CheckSpec", "checks_for", "decode_checks", "encode_checks"]


class CheckSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    # None: tool calls are not checked (the request declared no tools and no tool_choice).
    tools: dict[str, dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    # The structured answer's JSON Schema; None: the answer is free text, not checked.
    answer: dict[str, Any] | None = None


def checks_for(request: GenerateRequest) -> CheckSpec | None:
    """The request's declarations, or None when it declares nothing to check."""
    tools = (
        {tool.name: tool.parameters for tool in request.tools}
        if request.tools or request.tool_choice is not None
        else None
    )
    answer = request.response_format.schema if request.response_format is not None else None
    if tools is None and answer is None:
        return None
    return CheckSpec(tools=tools, tool_choice=request.tool_choice, answer=answer)


_ENCODER = msgspec.json.Encoder(order="sorted")
_DECODER = msgspec.json.Decoder(CheckSpec)


def encode_checks(spec: CheckSpec) -> bytes:
    """The spec as the status record stores it (keys sorted, so the same declarations give the same text)."""
    return _ENCODER.encode(spec)


def decode_checks(data: bytes | str) -> CheckSpec:
    """Raises ``msgspec.DecodeError`` (``ValidationError`` included) for text that is not a spec."""
    return _DECODER.decode(data)

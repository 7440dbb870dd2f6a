"""Sluice's own request shape: one description of a generation, whatever the provider.

Rule: a job describes its generation once, here; ``sluice.normalizer.requests`` turns it into each dialect's
exact HTTP request. The shape is strict (frozen, kw_only, unknown fields rejected) and checks what
must hold for *every* dialect when it is built or decoded; what only one provider cannot express is
refused by that dialect's builder. Both raise ``InvalidRequest``. Provider-native fields the shape does
not cover go in ``extra`` (merged into the body last, RFC 7396 JSON Merge Patch).

Validation (``InvalidRequest``; during ``msgspec`` decoding it surfaces as ``msgspec.ValidationError``
with the same message and a path, which ``decode_request`` turns back into ``InvalidRequest``):

- at least one message; a list ``content`` is never empty;
- ``user`` messages carry text parts only, ``assistant`` messages text, ``tool_call`` and ``reasoning``
  parts, ``tool`` messages ``tool_result`` parts only (so a tool message's content is always a list); a
  ``signature`` only on an assistant's parts; a reasoning part carries something (text, summary, signature
  or encrypted payload);
- every ``tool_call`` call id is unique in the conversation, and every ``tool_result`` answers a
  ``tool_call`` made earlier in it, at most once (Gemini needs the call's function name, resolved from
  its call id; OpenAI and Anthropic reject orphan results);
- tool names are unique and match ``[A-Za-z_][A-Za-z0-9_-]{0,63}``, the names every dialect accepts
  (OpenAI and Anthropic: ``[a-zA-Z0-9_-]{1,64}``; Gemini: must start with a letter or ``_``);
- ``tool_choice`` ``"required"`` or a named tool needs tools, and a named tool must be defined;
- ``response_format`` (a JSON-schema answer) names its schema like a tool (the same pattern); whether the
  schemas themselves are valid JSON Schema is checked at intake (``sluice.normalizer.checks``);
- ``reasoning`` gives ``effort``, ``budget_tokens`` (``budget_tokens: 0`` means "do not think") or
  ``include_encrypted``;
- numeric bounds: ``max_tokens >= 1``, ``temperature >= 0``, ``0 <= top_p <= 1``, ``budget_tokens >= 0``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from sluice.schemas.errors import JobError

__all__ = [
    "TOOL_NAME_PATTERN",
    "GenerateRequest",
    "InvalidRequest",
    "Message",
    "NamedToolChoice",
    "Part",
    "Reasoning",
    "ReasoningPart",
    "ResponseFormat",
    "TextPart",
    "Tool",
    "ToolCallPart",
    "ToolChoice",
    "ToolResultPart",
    "decode_request",
    "encode_request",
]

TOOL_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"


class InvalidRequest(JobError, ValueError):
    """The request cannot be sent: it breaks the shape's rules or the route's dialect cannot express it.

    Also a ``ValueError`` so that msgspec reports it, with its path, when it is raised while decoding.
    """

    code = "invalid_request"


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class TextPart(_Strict, frozen=True, tag_field="type", tag="text", kw_only=True):
    text: str
    # An assistant text part's opaque provider signature, sent back verbatim where the dialect has a place
    # for it (Gemini ``thoughtSignature`` on a text part); else ignored.
    signature: str | None = None


class ToolCallPart(_Strict, frozen=True, tag_field="type", tag="tool_call", kw_only=True):
    """A tool call the assistant made earlier in the conversation."""

    call_id: Annotated[str, msgspec.Meta(min_length=1)]
    name: Annotated[str, msgspec.Meta(min_length=1)]
    arguments: dict[str, Any] = {}
    # The provider's opaque signature for this call, sent back verbatim where the dialect has a place
    # for it (Gemini ``thoughtSignature``, which Gemini 3 requires on function calls); else ignored.
    signature: str | None = None


class ToolResultPart(_Strict, frozen=True, tag_field="type", tag="tool_result", kw_only=True):
    call_id: Annotated[str, msgspec.Meta(min_length=1)]
    content: str
    is_error: bool = False


class ReasoningPart(_Strict, frozen=True, tag_field="type", tag="reasoning", kw_only=True):
    """Reasoning the assistant did earlier in the conversation, kept so the provider that produced it
    (``dialect``) gets it back on the next turn, as multi-turn tool use with reasoning needs: an
    Anthropic ``thinking`` block (``text`` + ``signature``) or ``redacted_thinking`` (``encrypted``), an
    OpenAI Responses reasoning item (``summary`` texts, raw ``text``, ``encrypted`` content), a Gemini
    thought part (``text`` + ``signature``). Signatures are only valid where they were made: a request
    in any other dialect leaves the part out and says so in its warnings.
    ``sluice.schemas.result.Result.as_message`` builds these from a result."""

    dialect: Annotated[str, msgspec.Meta(min_length=1)]
    text: str = ""
    summary: list[str] = []
    signature: str | None = None
    encrypted: str | None = None

    def __post_init__(self) -> None:
        if not (self.text or self.summary or self.signature or self.encrypted):
            raise InvalidRequest("a reasoning part carries no text, summary, signature or encrypted payload")


Part = TextPart | ToolCallPart | ToolResultPart | ReasoningPart

# Which part types each role may carry.
_ALLOWED_PARTS: dict[str, tuple[type, ...]] = {
    "user": (TextPart,),
    "assistant": (TextPart, ToolCallPart, ReasoningPart),
    "tool": (ToolResultPart,),
}


class Message(_Strict, frozen=True, kw_only=True):
    role: Literal["user", "assistant", "tool"]
    content: str | list[Part]

    def __post_init__(self) -> None:
        if isinstance(self.content, str):
            if self.role == "tool":
                raise InvalidRequest("tool messages carry tool_result parts, not a string")
            return
        if not self.content:
            raise InvalidRequest(f"{self.role} message content is an empty list")
        allowed = _ALLOWED_PARTS[self.role]
        for part in self.content:
            if not isinstance(part, allowed):
                kind = type(part).__struct_config__.tag
                raise InvalidRequest(f"{self.role} messages cannot carry {kind} parts")
            if self.role != "assistant" and isinstance(part, TextPart) and part.signature is not None:
                raise InvalidRequest(f"{self.role} messages cannot carry signatures")


def _default_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


class Tool(_Strict, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=TOOL_NAME_PATTERN)]
    description: str = ""
    # JSON Schema of the arguments object.
    parameters: dict[str, Any] = msgspec.field(default_factory=_default_parameters)


class NamedToolChoice(_Strict, frozen=True, kw_only=True):
    """Force a call to this tool."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class Reasoning(_Strict, frozen=True, kw_only=True):
    effort: Literal["low", "medium", "high"] | None = None
    budget_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # Ask for the reasoning in the form a later request can pass back: OpenAI Responses returns a
    # reasoning item's encrypted_content only when asked (``include: ["reasoning.encrypted_content"]``),
    # and without it the item cannot be replayed statelessly. Anthropic and Gemini always return their
    # signatures, so there it changes nothing.
    include_encrypted: bool = False

    def __post_init__(self) -> None:
        if self.effort is None and self.budget_tokens is None and not self.include_encrypted:
            raise InvalidRequest("reasoning needs effort, budget_tokens or include_encrypted")


class ResponseFormat(_Strict, frozen=True, kw_only=True):
    """Ask for the answer as JSON matching ``schema`` (a JSON Schema): each dialect's own structured-output
    field carries it (OpenAI ``response_format`` / Responses ``text.format``, Anthropic
    ``output_config.format``, Gemini ``responseJsonSchema``, Bedrock ``outputConfig.textFormat``), and the
    answer is checked against it when the stream completes. ``strict`` is OpenAI's strict mode (its subset
    of JSON Schema, enforced by constrained decoding); the other dialects have no such switch."""

    name: Annotated[str, msgspec.Meta(pattern=TOOL_NAME_PATTERN)] = "answer"
    description: str = ""
    schema: dict[str, Any]
    strict: bool = False


class GenerateRequest(_Strict, frozen=True, kw_only=True):
    system: str | None = None
    messages: list[Message]
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    stop: list[str] | None = None
    reasoning: Reasoning | None = None
    # A JSON-schema answer (structured output); None: free text.
    response_format: ResponseFormat | None = None
    # Provider-native body fields, merged into the built body last (RFC 7396: objects merge, null
    # deletes a key, anything else replaces).
    extra: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidRequest("messages is empty")
        self._check_tools()
        self._check_calls()

    def _check_tools(self) -> None:
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tool names are not unique")
        choice = self.tool_choice
        if choice == "required" and not self.tools:
            raise InvalidRequest('tool_choice "required" needs tools')
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not among the tools")

    def _check_calls(self) -> None:
        calls: set[str] = set()
        answered: set[str] = set()
        for index, message in enumerate(self.messages):
            if isinstance(message.content, str):
                continue
            for part in message.content:
                if isinstance(part, ToolCallPart):
                    if part.call_id in calls:
                        raise InvalidRequest(f"messages[{index}]: tool call id {part.call_id!r} is reused")
                    calls.add(part.call_id)
                elif isinstance(part, ToolResultPart):
                    if part.call_id not in calls:
                        raise InvalidRequest(
                            f"messages[{index}]: tool result for {part.call_id!r} answers no earlier tool call"
                        )
                    if part.call_id in answered:
                        raise InvalidRequest(f"messages[{index}]: tool call {part.call_id!r} answered twice")
                    answered.add(part.call_id)


_DECODER: msgspec.json.Decoder[GenerateRequest] = msgspec.json.Decoder(GenerateRequest)
_ENCODER = msgspec.json.Encoder()


def decode_request(data: bytes | str) -> GenerateRequest:
    """Decode and validate a JSON request. Raises ``InvalidRequest`` (the message names the path)."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise InvalidRequest(f"invalid request: {exc}") from exc


def encode_request(req: GenerateRequest) -> bytes:
    return _ENCODER.encode(req)

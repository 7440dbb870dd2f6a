"""The normalized event contract: what every sluice consumer reads.

Rule: this module is the wire contract. Events are strict msgspec Structs in a tagged union on
``type``; new fields get defaults, tags are never reused and field types never change. Bump
``CONTRACT_VERSION`` (minor for additions, major for anything else) with every change. Each vocabulary is
written once, as a ``Literal``; its tuple (for runtime checks) is derived from it with ``get_args``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import msgspec

from sluice.schemas.states import FailedState

__all__ = [
    "ARGUMENTS_ERRORS",
    "BLOCK_DELTA_KINDS",
    "BLOCK_KINDS",
    "CHECK_POLICIES",
    "CHECK_REASONS",
    "CONTRACT_VERSION",
    "DELTA_KINDS",
    "ERROR_CATEGORIES",
    "EVENT_TAGS",
    "EVENT_TYPES",
    "MAX_CHECK_MESSAGE",
    "MAX_VERDICT_ERRORS",
    "RETRYABLE_CATEGORIES",
    "STOP_REASONS",
    "VISIBILITIES",
    "ArgumentsError",
    "Block",
    "BlockDelta",
    "BlockKind",
    "BlockStart",
    "BlockStop",
    "CheckError",
    "CheckPolicy",
    "CheckReason",
    "Delta",
    "DeltaKind",
    "ErrorCategory",
    "ErrorInfo",
    "Event",
    "EventBase",
    "OpenBlock",
    "StopReason",
    "StreamDone",
    "StreamError",
    "StreamStart",
    "StreamWarning",
    "Usage",
    "Verdict",
    "Visibility",
    "decode_event",
    "encode_event",
]

CONTRACT_VERSION = "1.4"

BlockKind = Literal["text", "tool_call", "reasoning", "refusal"]
DeltaKind = Literal["text", "json_text", "signature"]
StopReason = Literal["stop", "tool_use", "length", "content_filter", "refusal", "pause_turn", "other"]
Visibility = Literal["internal", "public"]
# Why a tool call's block.stop carries no arguments (1.1): the provider cut the output (its terminal
# says the token limit was reached) inside the call's JSON, so the call is not whole.
ArgumentsError = Literal["truncated"]
# (1.3) What an attempt does with output that fails its checks (docs/contract.md#output-checks): ``record``
# (the stream goes on, the verdict says what is wrong) or ``fail`` (the attempt ends failed, invalid_output).
CheckPolicy = Literal["record", "fail"]
# (1.3) Why a verdict is invalid: the arguments or answer do not match the schema; the call names a tool the
# job did not declare; it breaks the job's tool_choice (none, or another tool named); the answer is not JSON.
CheckReason = Literal["schema", "undeclared_tool", "tool_choice", "not_json"]
ErrorCategory = Literal[
    # reported by providers
    "overloaded",
    "rate_limit",
    "server_error",
    "invalid_request",
    "authentication",
    "permission",
    "not_found",
    "billing",
    "unknown",
    # detected by sluice
    "protocol",
    "transport",
    "timeout",
    "cancelled",
    "worker_lost",
    "limit_exceeded",
    "invalid_output",  # (1.3) a tool call or answer failed its checks under the policy "fail"; never retried
    "budget_exceeded",  # (1.4) a budget the job falls under has no room for the attempt's worst case; never retried
]

BLOCK_KINDS: tuple[BlockKind, ...] = get_args(BlockKind)
# (1.3) The most errors a verdict lists, and the longest message it carries (characters, "…" when cut).
MAX_VERDICT_ERRORS = 5
MAX_CHECK_MESSAGE = 200
DELTA_KINDS: tuple[DeltaKind, ...] = get_args(DeltaKind)
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)
VISIBILITIES: tuple[Visibility, ...] = get_args(Visibility)
ARGUMENTS_ERRORS: tuple[ArgumentsError, ...] = get_args(ArgumentsError)
ERROR_CATEGORIES: tuple[ErrorCategory, ...] = get_args(ErrorCategory)
CHECK_POLICIES: tuple[CheckPolicy, ...] = get_args(CheckPolicy)
CHECK_REASONS: tuple[CheckReason, ...] = get_args(CheckReason)
# Which delta kinds each block kind takes. Signatures are opaque integrity tokens kept with the block
# they came with: Anthropic signs thinking; Gemini signs text and function-call parts too.
BLOCK_DELTA_KINDS: dict[BlockKind, frozenset[DeltaKind]] = {
    "text": frozenset({"text", "signature"}),
    "tool_call": frozenset({"json_text", "signature"}),
    "reasoning": frozenset({"text", "signature"}),
    "refusal": frozenset({"text"}),
}
# Provider-reported categories a caller may retry; sluice's own categories say nothing about a retry
# by themselves (the worker decides, e.g. `transport` before anything was visible).
RETRYABLE_CATEGORIES: frozenset[ErrorCategory] = frozenset({"overloaded", "rate_limit", "server_error"})


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Block(_Strict, omit_defaults=True, kw_only=True, frozen=True):
    """Identifies a block. ``index`` counts blocks in the order they start in this stream."""

    id: str
    index: int
    kind: BlockKind


class OpenBlock(Block, omit_defaults=True, kw_only=True, frozen=True):
    """The block as announced by ``block.start``: tool calls name the tool, reasoning its visibility."""

    name: str | None = None
    call_id: str | None = None
    # True when the provider gave no call id and sluice made one up (Gemini omits it).
    call_id_synthesized: bool = False
    visibility: Visibility | None = None
    # (1.1) Reasoning the provider sent only as an opaque encrypted payload, no text: the block's signature
    # deltas are that payload, to pass back unchanged (Anthropic redacted_thinking, an OpenAI Responses
    # reasoning item's encrypted_content).
    encrypted: bool = False


class Delta(_Strict, kw_only=True, frozen=True):
    kind: DeltaKind
    text: str


class Usage(_Strict, kw_only=True, frozen=True):
    """Token counts; ``None`` where the provider did not say."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    total_tokens: int | None = None
    # (1.4) The provider's own reported cost of the request, a decimal string in the provider's currency
    # (OpenRouter's ``usage.cost``, US dollars of credits); absent where the dialect carries none. Kept beside
    # the cost sluice computes from the tokens, so the two can be reconciled.
    provider_cost: str | msgspec.UnsetType = msgspec.UNSET


class ErrorInfo(_Strict, kw_only=True, frozen=True):
    category: ErrorCategory
    retryable: bool
    provider_code: str | None = None
    # Safe to show a user: never a secret, never prompt text.
    message: str
    # The block at fault, e.g. a tool call whose arguments were not valid JSON.
    block_index: int | None = None


class CheckError(_Strict, kw_only=True, frozen=True):
    """(1.3) One way a checked value fails: where (an RFC 6901 JSON pointer into the arguments or the
    answer, "" for the whole value), the schema keyword that failed ("" when no keyword did: an undeclared
    tool, text that is not JSON) and a message (bounded)."""

    pointer: str
    keyword: str
    message: str


class Verdict(_Strict, omit_defaults=True, kw_only=True, frozen=True):
    """(1.3) A tool call's or a structured answer's check: ``valid``, else why and the first few errors
    (``MAX_VERDICT_ERRORS`` at most, in the validator's order; ``more_errors`` when it found more)."""

    valid: bool
    reason: CheckReason | None = None
    errors: list[CheckError] = []
    more_errors: bool = False


class EventBase(_Strict, tag_field="type", kw_only=True, frozen=True):
    stream_id: str
    request_id: str
    seq: int
    ts: int
    # Indices of the raw provider events (within this attempt) this event came from.
    raw: list[int] = []


class StreamStart(EventBase, tag="stream.start", kw_only=True, frozen=True):
    provider: str
    dialect: str
    model: str | None
    attempt: int
    # (1.2) The configured route this attempt ran on: the job's own, or a fallback route. Absent (read as
    # "") where no route is known (the normalizer run on its own), so such events stay what 1.1 wrote.
    route: str | msgspec.UnsetType = msgspec.UNSET
    # (1.3) Present when this attempt's output is checked against the job's declarations (tool calls at
    # their block.stop, a structured answer at stream.done): what an invalid one does. Absent: no verdicts.
    checks: CheckPolicy | msgspec.UnsetType = msgspec.UNSET


class BlockStart(EventBase, tag="block.start", kw_only=True, frozen=True):
    block: OpenBlock


class BlockDelta(EventBase, tag="block.delta", kw_only=True, frozen=True):
    block: Block
    delta: Delta


class BlockStop(EventBase, tag="block.stop", kw_only=True, frozen=True):
    block: Block
    # Only for tool_call blocks: the arguments parsed once, at the stop.
    arguments: dict[str, Any] | None = None
    # (1.1) Only on a tool call whose arguments are null: why. Absent (not null) otherwise, so events
    # that have nothing to say here are byte for byte what contract 1.0 wrote.
    arguments_error: ArgumentsError | msgspec.UnsetType = msgspec.UNSET
    # (1.3) Only on a tool call with parsed arguments in an attempt whose stream.start names ``checks``:
    # the call held against the job's declared tools, its tool_choice and the tool's JSON Schema.
    verdict: Verdict | msgspec.UnsetType = msgspec.UNSET


class StreamWarning(EventBase, tag="stream.warning", kw_only=True, frozen=True):
    """Optional, never required of a client: something was odd but the stream goes on."""

    code: str
    message: str
    count: int = 1


class StreamDone(EventBase, tag="stream.done", kw_only=True, frozen=True):
    status: Literal["completed"] = "completed"
    stop_reason: StopReason
    provider_stop_reason: str | None
    usage: Usage | None
    # (1.3) The structured answer's check, when the job asked for a JSON-schema answer and the turn ended
    # with its answer (stop reason ``stop`` or ``length``).
    answer: Verdict | msgspec.UnsetType = msgspec.UNSET


class StreamError(EventBase, tag="stream.error", kw_only=True, frozen=True):
    status: FailedState
    error: ErrorInfo
    # What the provider had reported before the stream ended (it is billed all the same).
    usage: Usage | None = None
    # (1.3) Only on an ``invalid_output`` failure of the answer (policy "fail"): the answer's verdict.
    answer: Verdict | msgspec.UnsetType = msgspec.UNSET


Event = StreamStart | BlockStart | BlockDelta | BlockStop | StreamWarning | StreamDone | StreamError
# Each event class's ``type`` tag (what the events stream's ``type`` field holds), and the tags in order.
EVENT_TAGS: dict[type[EventBase], str] = {t: str(t.__struct_config__.tag) for t in get_args(Event)}
EVENT_TYPES: tuple[str, ...] = tuple(EVENT_TAGS.values())

_DECODER: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)

# The contract's one JSON encoding: msgspec's encoder method itself, not a Python function around it, since
# every event stored goes through it (no frame of its own per event).
encode_event: Callable[[Event], bytes] = msgspec.json.Encoder().encode


def decode_event(data: bytes | str) -> Event:
    """Decode one contract event; raises ``msgspec.ValidationError`` on anything off-contract."""
    return _DECODER.decode(data)

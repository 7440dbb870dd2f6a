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
    "CONTRACT_VERSION",
    "DELTA_KINDS",
    "ERROR_CATEGORIES",
    "EVENT_TAGS",
    "EVENT_TYPES",
    "RETRYABLE_CATEGORIES",
    "STOP_REASONS",
    "VISIBILITIES",
    "ArgumentsError",
    "Block",
    "BlockDelta",
    "BlockKind",
    "BlockStart",
    "BlockStop",
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
    "Visibility",
    "decode_event",
    "encode_event",
]

CONTRACT_VERSION = "1.2"

BlockKind = Literal["text", "tool_call", "reasoning", "refusal"]
DeltaKind = Literal["text", "json_text", "signature"]
StopReason = Literal["stop", "tool_use", "length", "content_filter", "refusal", "pause_turn", "other"]
Visibility = Literal["internal", "public"]
# Why a tool call's block.stop carries no arguments (1.1): the provider cut the output (its terminal
# says the token limit was reached) inside the call's JSON, so the call is not whole.
ArgumentsError = Literal["truncated"]
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
]

BLOCK_KINDS: tuple[BlockKind, ...] = get_args(BlockKind)
DELTA_KINDS: tuple[DeltaKind, ...] = get_args(DeltaKind)
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)
VISIBILITIES: tuple[Visibility, ...] = get_args(Visibility)
ARGUMENTS_ERRORS: tuple[ArgumentsError, ...] = get_args(ArgumentsError)
ERROR_CATEGORIES: tuple[ErrorCategory, ...] = get_args(ErrorCategory)
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


class ErrorInfo(_Strict, kw_only=True, frozen=True):
    category: ErrorCategory
    retryable: bool
    provider_code: str | None = None
    # Safe to show a user: never a secret, never prompt text.
    message: str
    # The block at fault, e.g. a tool call whose arguments were not valid JSON.
    block_index: int | None = None


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


class StreamError(EventBase, tag="stream.error", kw_only=True, frozen=True):
    status: FailedState
    error: ErrorInfo
    # What the provider had reported before the stream ended (it is billed all the same).
    usage: Usage | None = None


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

"""The small vocabulary adapters use to drive the state machine.

Rule: an adapter translates one provider event into a list of these actions and nothing else; it names
blocks by its own provider-side ``key`` (any hashable), and the machine maps keys to the contract's
block ids and indices, assigns seq and enforces every invariant. Actions are frozen msgspec Structs, not
dataclasses: one or more is built per provider event, and a frozen dataclass's ``__init__`` (a Python
``object.__setattr__`` per field) cost several times a Struct's.
"""

from __future__ import annotations

from collections.abc import Hashable

import msgspec

from sluice.schemas.events import BlockKind, DeltaKind, ErrorCategory, StopReason, Usage, Visibility

__all__ = [
    "Action",
    "Append",
    "Close",
    "Fail",
    "Finish",
    "Ignore",
    "Open",
    "SetUsage",
    "Start",
    "Warn",
]


class Start(msgspec.Struct, frozen=True):
    model: str | None = None
    response_id: str | None = None  # the provider's id of the response (telemetry only; not in the contract)


class Open(msgspec.Struct, frozen=True):
    key: Hashable
    kind: BlockKind
    name: str | None = None
    call_id: str | None = None
    visibility: Visibility | None = None
    encrypted: bool = False  # reasoning that is only an encrypted payload (its signature deltas)


class Append(msgspec.Struct, frozen=True):
    key: Hashable
    kind: DeltaKind
    text: str


class Close(msgspec.Struct, frozen=True):
    key: Hashable


class SetUsage(msgspec.Struct, frozen=True):
    """Usage seen mid-stream; later values replace earlier ones field by field (never summed)."""

    usage: Usage


class Finish(msgspec.Struct, frozen=True):
    """The provider's documented terminal signal. ``stop_reason`` is already normalized; the machine
    upgrades a natural ``stop`` to ``tool_use`` or ``refusal`` from what the turn produced."""

    stop_reason: StopReason
    provider_stop_reason: str | None
    usage: Usage | None = None


class Fail(msgspec.Struct, frozen=True):
    """The provider reported an error inside the stream (or the adapter found one). ``usage`` is what the
    same provider event reported beside the error (merged like ``SetUsage``): the failed request is billed
    all the same, and a ``SetUsage`` after the ``Fail`` would come after the terminal."""

    category: ErrorCategory
    provider_code: str | None
    message: str
    retryable: bool | None = None  # None: derived from the category
    usage: Usage | None = None


class Warn(msgspec.Struct, frozen=True):
    code: str
    message: str


class Ignore(msgspec.Struct, frozen=True):
    """A provider event sluice does not translate (unknown type, ping, annotation). Counted; the raw
    log keeps it."""

    what: str
    unknown: bool = True


Action = Start | Open | Append | Close | SetUsage | Finish | Fail | Warn | Ignore

"""The small vocabulary adapters use to drive the state machine.

Rule: an adapter translates one provider event into a list of these actions and nothing else; it names
blocks by its own provider-side ``key`` (any hashable), and the machine maps keys to the contract's
block ids and indices, assigns seq and enforces every invariant.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Start:
    model: str | None = None
    response_id: str | None = None  # the provider's id of the response (telemetry only; not in the contract)


@dataclass(frozen=True, slots=True)
class Open:
    key: Hashable
    kind: BlockKind
    name: str | None = None
    call_id: str | None = None
    visibility: Visibility | None = None
    encrypted: bool = False  # reasoning that is only an encrypted payload (its signature deltas)


@dataclass(frozen=True, slots=True)
class Append:
    key: Hashable
    kind: DeltaKind
    text: str


@dataclass(frozen=True, slots=True)
class Close:
    key: Hashable


@dataclass(frozen=True, slots=True)
class SetUsage:
    """Usage seen mid-stream; later values replace earlier ones field by field (never summed)."""

    usage: Usage


@dataclass(frozen=True, slots=True)
class Finish:
    """The provider's documented terminal signal. ``stop_reason`` is already normalized; the machine
    upgrades a natural ``stop`` to ``tool_use`` or ``refusal`` from what the turn produced."""

    stop_reason: StopReason
    provider_stop_reason: str | None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Fail:
    """The provider reported an error inside the stream (or the adapter found one). ``usage`` is what the
    same provider event reported beside the error (merged like ``SetUsage``): the failed request is billed
    all the same, and a ``SetUsage`` after the ``Fail`` would come after the terminal."""

    category: ErrorCategory
    provider_code: str | None
    message: str
    retryable: bool | None = None  # None: derived from the category
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Warn:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Ignore:
    """A provider event sluice does not translate (unknown type, ping, annotation). Counted; the raw
    log keeps it."""

    what: str
    unknown: bool = True


Action = Start | Open | Append | Close | SetUsage | Finish | Fail | Warn | Ignore

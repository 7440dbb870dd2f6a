"""The adapter interface every dialect implements.

Rule: an adapter is a pure translator from one provider ``SSEEvent`` (an SSE event, or an AWS event-stream
message for ``FRAMING = "eventstream"``) to machine ``Action``s. It keeps
only the state the provider leaves implicit (is a block open? which key is it?); the machine checks
sequencing, assigns seq and parses tool arguments. An event's data decodes straight into the dialect's view
struct: JSON that does not fit raises ``msgspec.DecodeError``, which the ``Normalizer`` (the one caller)
turns into the protocol error for every dialect; other malformed payloads raise ``ProviderProtocolError``;
unknown events become ``Ignore`` and are never a crash.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Literal

from sluice.normalizer.actions import Action
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.events import ErrorCategory, StopReason

__all__ = ["Adapter", "as_str", "safe_message"]


class Adapter(abc.ABC):
    #: the dialect name used in jobs, routes and ``sluice normalize --dialect``
    dialect: ClassVar[str]
    #: the provider family named in ``stream.start``
    provider: ClassVar[str]
    #: provider stop reason -> normalized stop reason (data, listed in the README)
    STOP_REASONS: ClassVar[dict[str, StopReason]] = {}
    #: provider error code -> normalized error category
    ERROR_CATEGORIES: ClassVar[dict[str, ErrorCategory]] = {}
    #: the documented terminal signals, for the README and tests
    TERMINAL_SIGNALS: ClassVar[dict[str, str]] = {}
    #: the provider may append an error body without SSE framing (the decoder's ``unframed_json``)
    UNFRAMED_JSON: ClassVar[bool] = False
    #: the response body's framing: ``text/event-stream`` or AWS event-stream (``sluice.normalizer.eventstream``)
    FRAMING: ClassVar[Literal["sse", "eventstream"]] = "sse"

    @abc.abstractmethod
    def feed(self, sse: SSEEvent) -> list[Action]:
        """Translate one dispatched SSE event. Raises ``msgspec.DecodeError`` when its data is not the
        dialect's JSON, ``ProviderProtocolError`` on other malformed payloads."""

    def end(self) -> list[Action]:
        """The transport ended (EOF). Dialects whose terminal signal is only confirmed by EOF (Gemini)
        finish here; the others return nothing and the machine reports the interruption."""
        return []

    @classmethod
    def stop_reason(cls, provider_reason: str | None) -> StopReason:
        return cls.STOP_REASONS.get(provider_reason or "", "other")

    @classmethod
    def error_category(cls, code: str | None) -> ErrorCategory:
        return cls.ERROR_CATEGORIES.get(code or "", "unknown")


def as_str(value: Any) -> str | None:
    """Provider codes are sometimes numbers (OpenRouter sends 502); the contract carries strings."""
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def safe_message(message: Any, fallback: str) -> str:
    """Provider error messages carry no secrets but may quote input: keep them short (and a string)."""
    text = (message if isinstance(message, str) else "").strip() or fallback
    return text if len(text) <= 300 else text[:297] + "..."

"""Resume positions: the event-stream entry id ``<attempt>-<seq>`` a relay client sends back.

Rule: a position names one normalized event exactly (the worker writes event ``seq`` of attempt ``A`` at
entry id ``A-seq``), so "the events after P" is the same set on every relay instance and across restarts.
``0-0`` (or an empty value) is the start of the request; a bare integer ``S`` means ``1-S`` (the first
attempt), as in ``SluiceClient.events(after=S)``. Anything else is rejected, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.schemas.events import Event, StreamDone, StreamError
from sluice.schemas.keys import Position

__all__ = ["START", "Entry", "Position", "PositionError", "parse_position"]

# ASCII digits only: ``\d`` alone also matches other scripts' digits, which ``int`` would accept.
_POSITION = re.compile(r"(\d{1,19})-(\d{1,19})", re.ASCII)
_SEQ = re.compile(r"\d{1,19}", re.ASCII)


class PositionError(ValueError):
    """A resume position that is not ``<attempt>-<seq>``; the message says what was received."""


START = Position(0, 0)


def parse_position(value: str | None) -> Position:
    """Parse a ``Last-Event-ID`` header or ``?after=`` value. Raises ``PositionError``."""
    text = (value or "").strip()
    if not text:
        return START
    if m := _POSITION.fullmatch(text):
        return Position(int(m.group(1)), int(m.group(2)))
    if _SEQ.fullmatch(text):
        seq = int(text)
        return Position(1, seq) if seq else START
    raise PositionError(f"not a position <attempt>-<seq>: {text[:40]!r}")


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a request's event stream: its position, the contract JSON exactly as stored, and
    the event decoded once (by the reader that fetched it) for every client to share."""

    position: Position
    type: str
    data: bytes
    event: Event

    @property
    def is_terminal(self) -> bool:
        return isinstance(self.event, StreamDone | StreamError)

"""Which events a client may see: internal reasoning is withheld unless its token allows it.

Rule: a reasoning block whose ``block.start`` does not say ``visibility: "public"`` is internal, and its
``block.start``, ``block.delta`` and ``block.stop`` are dropped for a client without the grant; every
other event passes unchanged, so the positions of later events stay exact. In place of the withheld
``block.start`` the client gets one relay notice, ``block.withheld`` (same position; the block's id, index
and kind, never its content), so a UI can say that reasoning happened and was not shown. Blocks are
identified per attempt (indices restart with each attempt's ``stream.start``). A delta of a reasoning
block whose start this filter never saw is withheld too (when in doubt, hide). Pure: feed it entries in
stream order.
"""

from __future__ import annotations

import msgspec

from sluice.schemas.events import BlockDelta, BlockStart, BlockStop

from .positions import Entry

__all__ = ["WITHHELD", "VisibilityFilter", "withheld_notice"]

WITHHELD = "block.withheld"
_ENC = msgspec.json.Encoder()


def withheld_notice(entry: Entry) -> Entry:
    """The notice sent instead of a withheld block's ``block.start`` (the entry must be one)."""
    ev = entry.event
    assert isinstance(ev, BlockStart)
    doc = {
        "type": WITHHELD,
        "stream_id": ev.stream_id,
        "request_id": ev.request_id,
        "seq": ev.seq,
        "block": {"id": ev.block.id, "index": ev.block.index, "kind": ev.block.kind},
        "reason": "internal reasoning: the token does not grant it",
    }
    return Entry(entry.position, WITHHELD, _ENC.encode(doc), ev)


class VisibilityFilter:
    def __init__(self, allow_internal: bool) -> None:
        self.allow_internal = allow_internal
        self._attempt = -1
        self._hidden: set[int] = set()
        self._shown: set[int] = set()
        self.withheld = 0

    def keep(self, entry: Entry) -> bool:
        if self.allow_internal:
            return True
        if entry.position.attempt != self._attempt:
            self._attempt = entry.position.attempt
            self._hidden.clear()
            self._shown.clear()
        ev = entry.event
        if isinstance(ev, BlockStart):
            hidden = ev.block.kind == "reasoning" and ev.block.visibility != "public"
            (self._hidden if hidden else self._shown).add(ev.block.index)
        elif isinstance(ev, BlockDelta | BlockStop):
            index = ev.block.index
            hidden = index in self._hidden or (index not in self._shown and ev.block.kind == "reasoning")
        else:
            return True
        self.withheld += hidden
        return not hidden

    def view(self, entry: Entry) -> Entry | None:
        """What the client gets for ``entry``: itself, the withheld notice for a hidden block's start, or
        nothing."""
        if self.keep(entry):
            return entry
        return withheld_notice(entry) if isinstance(entry.event, BlockStart) else None

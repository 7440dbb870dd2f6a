"""Which events a client may see: internal reasoning is withheld unless its token allows it.

Rule: a reasoning block whose ``block.start`` does not say ``visibility: "public"`` is internal, and its
``block.start``, ``block.delta`` and ``block.stop`` are dropped for a client without the grant; every
other event passes unchanged, so the positions of later events stay exact. Blocks are identified per
attempt (indices restart with each attempt's ``stream.start``). A delta of a reasoning block whose start
this filter never saw is withheld too (when in doubt, hide). Pure: feed it entries in stream order.
"""

from __future__ import annotations

from sluice.schemas.events import BlockDelta, BlockStart, BlockStop

from .positions import Entry

__all__ = ["VisibilityFilter"]


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

"""Typed views of the stream replies redis-py gives for sluice's keys.

Rule: sluice's clients never decode responses, so stream names, entry ids and fields are bytes. Each reply
is cast once here rather than at every reader; nothing here imports redis, it only names the shapes.
"""

from __future__ import annotations

from typing import cast

__all__ = ["StreamEntry", "range_entries", "read_batches", "read_entries"]

StreamEntry = tuple[bytes, dict[bytes, bytes]]  # (entry id, fields)


def range_entries(reply: object) -> list[StreamEntry]:
    """The entries of an ``XRANGE`` / ``XREVRANGE`` reply, in order."""
    return cast(list[StreamEntry] | None, reply) or []


def read_batches(reply: object) -> list[tuple[bytes, list[StreamEntry]]]:
    """The ``(stream, entries)`` pairs of an ``XREAD`` / ``XREADGROUP`` reply; none when the block timed out."""
    return cast(list[tuple[bytes, list[StreamEntry]]] | None, reply) or []


def read_entries(reply: object) -> list[StreamEntry]:
    """The entries of an ``XREAD`` / ``XREADGROUP`` reply, all streams in order."""
    return [entry for _, batch in read_batches(reply) for entry in batch]

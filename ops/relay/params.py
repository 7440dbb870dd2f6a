"""Query parameters of the stream endpoints, validated before anything else happens.

Rule: every parameter is checked and a bad one is ``400`` with a message naming it, never a 500 and never
a silent default: unknown names (a typo like ``coalesce=50`` would otherwise be ignored), a repeated
name, values outside ASCII digits (``str.isdigit`` accepts ``²``, which ``int`` refuses), numbers out of
range, and positions that are not ``<attempt>-<seq>`` (with ``?format=ai-sdk`` also a chunk id
``<attempt>-<seq>.<k>``). ``Last-Event-ID`` wins over ``?after=``: a browser
sends it on every reconnect, so it is the newer position.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .positions import Position, PositionError, parse_position

__all__ = ["FORMATS", "ParamError", "StreamParams", "parse_stream_params"]

FORMATS = ("sse", "ai-sdk")
_KNOWN = frozenset({"token", "after", "coalesce_ms", "format"})
_DIGITS = re.compile(r"[0-9]{1,9}", re.ASCII)
# Request ids are the producer's choice; the relay only refuses what cannot be a key or a header value.
_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}", re.ASCII)
_CHUNK_ID = re.compile(r"([0-9]{1,19}-[0-9]{1,19})\.([0-9]{1,9})", re.ASCII)


class ParamError(ValueError):
    """A bad parameter: the relay answers 400 with this message."""


@dataclass(frozen=True, slots=True)
class StreamParams:
    after: Position
    after_part: int | None  # ai-sdk chunk ids ``<attempt>-<seq>.<k>``: after the k-th chunk of that event
    window: float  # coalescing window in seconds (0: events one to one)
    format: str
    token: str | None


def parse_stream_params(
    items: Sequence[tuple[str, str]],
    headers: Mapping[str, str],
    *,
    max_coalesce_ms: int,
    formats: Sequence[str] = FORMATS,
) -> StreamParams:
    """Validate a stream request's query (as ``(name, value)`` pairs, repeats kept) and its
    ``Last-Event-ID``. Raises ``ParamError``."""
    seen: dict[str, str] = {}
    for name, value in items:
        if name not in _KNOWN:
            raise ParamError(f"unknown parameter {name[:40]!r} (accepted: {', '.join(sorted(_KNOWN))})")
        if name in seen:
            raise ParamError(f"parameter {name!r} given more than once")
        seen[name] = value
    token = seen.get("token")
    if token is not None and not _TOKEN.fullmatch(token):
        raise ParamError("token must be 1..4096 printable ASCII characters")
    raw = seen.get("coalesce_ms", "0")
    if not _DIGITS.fullmatch(raw) or int(raw) > max_coalesce_ms:
        raise ParamError(f"coalesce_ms must be an integer 0..{max_coalesce_ms}")
    fmt = seen.get("format", "sse")
    if fmt not in formats:
        raise ParamError(f"format must be one of {', '.join(formats)}")
    header = headers.get("last-event-id")
    text = (header if header is not None and header.strip() else seen.get("after")) or ""
    part: int | None = None
    if fmt == "ai-sdk" and (m := _CHUNK_ID.fullmatch(text.strip())):
        text, part = m.group(1), int(m.group(2))
    try:
        after = parse_position(text)
    except PositionError as exc:
        raise ParamError(str(exc)) from None
    return StreamParams(after=after, after_part=part, window=int(raw) / 1000, format=fmt, token=token)

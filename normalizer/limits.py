"""Bounds on what one request's stream may hold, so memory stays bounded whatever a peer sends.

Rule: every bound is a number in one place; passing any of them ends the stream ``failed`` /
``limit_exceeded`` with what was received before kept.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Limits"]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_line_bytes: int = 1 << 20
    max_event_bytes: int = 4 << 20
    max_total_bytes: int = 64 << 20
    max_raw_events: int = 200_000
    max_tool_argument_bytes: int = 1 << 20
    # Providers never send invalid UTF-8; when one does, the text is corrupt, so by default the stream
    # fails (`protocol`). "replace" keeps going with U+FFFD and a stream.warning.
    invalid_utf8: Literal["fail", "replace"] = "fail"

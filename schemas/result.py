"""The assembled result of one stream: what a caller stores or acts on once the stream is terminal.

Rule: a tool call's ``arguments`` is the parsed object only when the stream completed; otherwise it is
``None`` and the received text stays in ``arguments_text``, so nothing half-received can be executed.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from sluice.schemas.events import BlockKind, ErrorInfo, StopReason, Usage

__all__ = ["Result", "ResultBlock", "result_hash"]


class ResultBlock(msgspec.Struct, kw_only=True):
    index: int
    kind: BlockKind
    text: str | None = None
    signature: str | None = None
    name: str | None = None
    call_id: str | None = None
    arguments: dict[str, Any] | None = None
    arguments_text: str | None = None


class Result(msgspec.Struct, kw_only=True):
    status: Literal["running", "completed", "failed", "interrupted"]
    stop_reason: StopReason | None = None
    provider_stop_reason: str | None = None
    error: ErrorInfo | None = None
    usage: Usage | None = None
    blocks: list[ResultBlock] = []


def result_hash(result: Result) -> str:
    """A stable digest of a result: the audit compares it across re-normalizations."""
    return "sha256:" + hashlib.sha256(msgspec.json.encode(result, order="sorted")).hexdigest()

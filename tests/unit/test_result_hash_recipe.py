"""The consumer guide's ``result_hash`` recipe in plain Python (``json``, ``hashlib``), field by field as
the guide lists them, agrees with ``sluice.schemas.result.result_hash`` on every transcript's result."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from sluice.schemas.result import Result, result_hash
from tests.helpers import TRANSCRIPTS, run

BLOCK = ("arguments", "arguments_text", "call_id", "index", "kind", "name", "signature", "text")
ERROR = ("block_index", "category", "message", "provider_code", "retryable")
USAGE = ("cache_read_tokens", "cache_write_tokens", "input_tokens", "output_tokens", "reasoning_tokens", "total_tokens")


def _pick(obj: Any, names: tuple[str, ...]) -> dict[str, Any] | None:
    return None if obj is None else {n: msgspec.to_builtins(getattr(obj, n)) for n in names}


def guide_hash(result: Result) -> str:
    blocks = []
    for b in result.blocks:
        doc = _pick(b, BLOCK)
        assert doc is not None
        if b.arguments_error is not None:
            doc["arguments_error"] = b.arguments_error
        blocks.append(doc)
    doc = {
        "blocks": blocks,
        "error": _pick(result.error, ERROR),
        "provider_stop_reason": result.provider_stop_reason,
        "status": result.status,
        "stop_reason": result.stop_reason,
        "usage": _pick(result.usage, USAGE),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_the_guide_s_recipe_gives_the_stored_hash() -> None:
    results = [run(p.parent.name, p.read_bytes())[2] for p in sorted(TRANSCRIPTS.glob("*/*.sse"))]
    assert len(results) > 20
    assert {r.status for r in results} == {"completed", "failed", "interrupted"}
    assert any(b.arguments_error for r in results for b in r.blocks)
    assert any(b.visibility for r in results for b in r.blocks)  # left out of the hash
    assert [guide_hash(r) for r in results] == [result_hash(r) for r in results]

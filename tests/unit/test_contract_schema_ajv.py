"""The published JSON Schema as a JavaScript consumer uses it: compiled as-is by ajv's ``Ajv2020`` in
strict mode (the pinned ajv, under Node), agreeing with Python's ``jsonschema`` on every document.

Every event and result of every transcript (four dialects: completed, failed, interrupted, cut tool
calls) must validate; documents one field off (an unknown value, a missing or extra field, a wrong type,
an unknown event type) must be refused by both validators.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from sluice.schemas.events import encode_event
from sluice.schemas.jsonschema import SCHEMA_PATH
from tests.aisdk.harness import node_harness, run_node
from tests.helpers import TRANSCRIPTS, run

__all__ = ["node_harness"]

SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())


def _samples() -> list[tuple[str, Any]]:
    docs: list[tuple[str, Any]] = []
    for path in sorted(TRANSCRIPTS.glob("*/*.sse")):
        _, events, result = run(path.parent.name, path.read_bytes())
        docs += [("event", msgspec.json.decode(encode_event(e))) for e in events]
        docs.append(("result", msgspec.to_builtins(result)))
    return docs


def _bad(good: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    events = [d for kind, d in good if kind == "event"]
    done = next(d for d in events if d["type"] == "stream.done")
    stop = next(d for d in events if d["type"] == "block.stop" and d.get("arguments_error"))
    start = next(d for d in events if d["type"] == "block.start")
    result = next(d for kind, d in good if kind == "result")
    return [
        ("event", {**done, "stop_reason": "max_tokens"}),
        ("event", {**done, "surprise": 1}),
        ("event", {**done, "seq": "9"}),
        ("event", {k: v for k, v in done.items() if k != "usage"}),
        ("event", {**done, "type": "stream.finished"}),
        ("event", {**stop, "arguments_error": "repaired"}),
        ("event", {**start, "block": {**start["block"], "kind": "image"}}),
        ("result", {**result, "status": "done"}),
        ("result", {**result, "blocks": [{"index": 0}]}),
    ]


def _python(kind: str, doc: Any) -> bool:
    schema = (
        SCHEMA
        if kind == "event"
        else {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], "$ref": "#/$defs/Result"}
    )
    return jsonschema.Draft202012Validator(schema).is_valid(doc)


def _ajv(node_dir: Path, docs: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    lines = "".join(json.dumps([kind, doc]) + "\n" for kind, doc in docs).encode()
    _, out = run_node(node_dir, "schema.mjs", str(SCHEMA_PATH), stdin=lines)
    assert len(out["results"]) == len(docs)
    return list(out["results"])


def test_the_schema_says_its_draft_and_python_jsonschema_accepts_it() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_strict_ajv2020_compiles_the_schema_and_validates_every_sample(node_harness: Path) -> None:
    good = _samples()
    kinds = {d["type"] for kind, d in good if kind == "event"}
    assert kinds == {
        "stream.start",
        "block.start",
        "block.delta",
        "block.stop",
        "stream.warning",
        "stream.done",
        "stream.error",
    }
    verdicts = _ajv(node_harness, good)
    refused = [(doc, v["errors"]) for (_, doc), v in zip(good, verdicts, strict=True) if not v["valid"]]
    assert refused == []
    assert all(_python(kind, doc) for kind, doc in good)


def test_both_validators_refuse_documents_one_field_off(node_harness: Path) -> None:
    bad = _bad(_samples())
    verdicts = _ajv(node_harness, bad)
    assert [v["valid"] for v in verdicts] == [False] * len(bad), [
        doc for (_, doc), v in zip(bad, verdicts, strict=True) if v["valid"]
    ]
    assert [_python(kind, doc) for kind, doc in bad] == [False] * len(bad)


def test_the_schema_that_ajv_refused_before_is_refused_still(node_harness: Path, tmp_path: Path) -> None:
    """The check is real: the previous publication (an OpenAPI ``discriminator`` at the top) fails to compile."""
    old = {**SCHEMA, "discriminator": {"propertyName": "type"}}
    path = tmp_path / "old.schema.json"
    path.write_text(json.dumps(old))
    with pytest.raises(AssertionError, match="does not compile in strict Ajv2020"):
        run_node(node_harness, "schema.mjs", str(path), stdin=b"")

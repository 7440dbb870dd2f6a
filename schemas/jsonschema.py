"""The contract as JSON Schema (draft 2020-12), for consumers in other languages:
``python -m sluice.schemas.jsonschema`` rewrites ``schemas/contract.schema.json`` (a test fails when the
committed file is stale).

Rule: generated from the Structs, never edited by hand, and plain 2020-12 that mainstream validators
compile as published (ajv's ``Ajv2020`` in strict mode, Python's ``jsonschema``): the document is a
``oneOf`` of the seven events, each branch telling itself apart by a ``const`` ``type``; no vendor
keyword (msgspec's OpenAPI ``discriminator`` is dropped, strict validators refuse unknown keywords).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from sluice.schemas.events import CONTRACT_VERSION, Event
from sluice.schemas.result import Result

__all__ = ["DRAFT", "SCHEMA_PATH", "contract_schema", "render"]

SCHEMA_PATH = Path(__file__).with_name("contract.schema.json")
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def contract_schema() -> dict[str, Any]:
    (event, _result), components = msgspec.json.schema_components([Event, Result], ref_template="#/$defs/{name}")
    branches = event["anyOf"]
    for ref in branches:  # each event's ``type`` is a one-value Literal: its discriminator, as a const
        tag = components[ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]
        (value,) = tag.pop("enum")
        tag["const"] = value
    return {
        "$schema": DRAFT,
        "$id": f"https://sluice.dev/contract/{CONTRACT_VERSION}/contract.schema.json",
        "title": f"sluice normalized event contract {CONTRACT_VERSION}",
        "description": (
            "One normalized event (a line of the events stream), JSON Schema draft 2020-12; "
            "$defs/Result is the assembled result."
        ),
        "oneOf": branches,
        "$defs": components,
    }


def render() -> bytes:
    return msgspec.json.format(msgspec.json.encode(contract_schema(), order="sorted"), indent=2) + b"\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_bytes(render())
    print(f"wrote {SCHEMA_PATH}")

"""The contract as JSON Schema, for consumers in other languages: ``python -m sluice.schemas.jsonschema``
rewrites ``schemas/contract.schema.json`` (a test fails when the committed file is stale).

Rule: generated from the Structs, never edited by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from sluice.schemas.events import CONTRACT_VERSION, Event
from sluice.schemas.result import Result

__all__ = ["SCHEMA_PATH", "contract_schema", "render"]

SCHEMA_PATH = Path(__file__).with_name("contract.schema.json")


def contract_schema() -> dict[str, Any]:
    (event, _result), components = msgspec.json.schema_components([Event, Result], ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://sluice.dev/contract/{CONTRACT_VERSION}/contract.schema.json",
        "title": f"sluice normalized event contract {CONTRACT_VERSION}",
        "description": "One normalized event (a line of the events stream); $defs/Result is the assembled result.",
        **event,
        "$defs": components,
    }


def render() -> bytes:
    return msgspec.json.format(msgspec.json.encode(contract_schema(), order="sorted"), indent=2) + b"\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_bytes(render())
    print(f"wrote {SCHEMA_PATH}")

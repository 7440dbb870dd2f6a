import msgspec

from sluice.schemas.events import CONTRACT_VERSION, decode_event, encode_event
from sluice.schemas.jsonschema import SCHEMA_PATH, contract_schema, render
from tests.helpers import TRANSCRIPTS, run


def test_committed_schema_is_current() -> None:
    assert SCHEMA_PATH.read_bytes() == render(), "run: python -m sluice.schemas.jsonschema"


def test_schema_names_every_event_type() -> None:
    schema = contract_schema()
    tags = set()
    for d in schema["$defs"].values():
        t = d.get("properties", {}).get("type", {})
        if "enum" in t:
            tags.add(t["enum"][0])
    assert tags == {
        "stream.start", "block.start", "block.delta", "block.stop", "stream.warning", "stream.done", "stream.error",
    }
    assert CONTRACT_VERSION in schema["title"]


def test_contract_round_trips_and_rejects_unknown_fields() -> None:
    path = TRANSCRIPTS / "anthropic" / "text_tool_use.sse"
    _, events, _ = run("anthropic", path.read_bytes())
    for ev in events:
        assert decode_event(encode_event(ev)) == ev
    doc = msgspec.json.decode(encode_event(events[0]))
    doc["surprise"] = 1
    try:
        decode_event(msgspec.json.encode(doc))
    except msgspec.ValidationError as exc:
        assert "surprise" in str(exc)
    else:
        raise AssertionError("an unknown field was accepted")

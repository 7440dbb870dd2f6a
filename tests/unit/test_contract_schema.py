import msgspec
import pytest

from sluice.schemas.events import CONTRACT_VERSION, decode_event, encode_event
from sluice.schemas.jsonschema import SCHEMA_PATH, contract_schema, render
from tests.helpers import TRANSCRIPTS, run

PINNED_1_0_HASH = "sha256:a22dd7866576d5b7edf602d61013775b15ff642457fdd2c50988f8b4c449f5ba"


def test_committed_schema_is_current() -> None:
    assert SCHEMA_PATH.read_bytes() == render(), "run: python -m sluice.schemas.jsonschema"


def test_schema_names_every_event_type() -> None:
    schema = contract_schema()
    # one oneOf branch per event, each told apart by its const ``type`` (no vendor discriminator keyword)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "discriminator" not in schema and "anyOf" not in schema
    tags = [schema["$defs"][b["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["const"] for b in schema["oneOf"]]
    assert len(tags) == len(set(tags))
    assert set(tags) == {
        "stream.start",
        "block.start",
        "block.delta",
        "block.stop",
        "stream.warning",
        "stream.done",
        "stream.error",
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


def test_every_event_the_suite_produces_is_checked_against_the_schema() -> None:
    from sluice.normalizer.machine import StreamMachine
    from sluice.schemas.invariants import ContractChecker

    # tests/conftest.py wraps the machine and the checker for the whole session.
    for method in (StreamMachine.process, StreamMachine.fail, StreamMachine.interrupt, StreamMachine.result):
        assert hasattr(method, "__wrapped__")
    assert hasattr(ContractChecker.process, "__wrapped__")


def test_the_validator_is_real() -> None:
    from tests.schema_check import _EVENTS, SchemaMismatch, _check

    _, events, _ = run("anthropic", (TRANSCRIPTS / "anthropic" / "max_tokens_in_tool_json.sse").read_bytes())
    good = [msgspec.json.decode(encode_event(e)) for e in events]
    for doc in good:
        _check(_EVENTS, msgspec.json.encode(doc))
    stop = next(d for d in good if d.get("arguments_error"))
    done = good[-1]
    for bad in (
        {**stop, "arguments_error": "repaired"},
        {**stop, "arguments_error": None},
        {**done, "stop_reason": "max_tokens"},
        {**done, "surprise": 1},
        {**done, "seq": "9"},
        {k: v for k, v in done.items() if k != "usage"},
    ):
        with pytest.raises(SchemaMismatch):
            _check(_EVENTS, msgspec.json.encode(bad))


def test_a_result_without_1_1_features_hashes_as_under_1_0() -> None:
    # Pinned before contract 1.1: status records written by older workers must still verify.
    from sluice.schemas.result import result_hash

    _, _, result = run("anthropic", (TRANSCRIPTS / "anthropic" / "thinking_then_text.sse").read_bytes())
    assert result.dialect == "anthropic" and result.blocks[0].visibility == "internal"
    assert result_hash(result) == PINNED_1_0_HASH

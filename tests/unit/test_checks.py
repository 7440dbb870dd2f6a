"""Output checks (contract 1.3): verdicts, the validator cache, intake's schema problems, the machine's
policies, and the chosen validator (jsonschema-rs) held to the reference implementation (python-jsonschema)
by hypothesis over generated schemas and instances."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from referencing import Registry

from sluice.normalizer.actions import Append, Close, Finish, Open, Start
from sluice.normalizer.checks import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    VALID,
    Checker,
    SchemaProblem,
    ValidatorCache,
    schema_problem,
    validator_version,
)
from sluice.normalizer.machine import StreamMachine
from sluice.schemas.checks import CheckSpec, checks_for, decode_checks, encode_checks
from sluice.schemas.errors import ProviderProtocolError
from sluice.schemas.events import BlockStop, CheckError, StreamDone, StreamError, StreamStart, Verdict
from sluice.schemas.request import NamedToolChoice, decode_request
from tests.helpers import briefs, check_invariants, info

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city"],
    "additionalProperties": False,
}


EXTRA = "are not allowed ('x' was unexpected)"


def checker(policy: str = "record", **spec: Any) -> Checker:
    return Checker.compile(CheckSpec(**spec), policy, ValidatorCache())  # type: ignore[arg-type]


# -- verdicts ---------------------------------------------------------------------------------------------


def test_a_valid_call_is_valid() -> None:
    assert checker(tools={"weather": WEATHER}).check_call("weather", {"city": "Paris", "unit": "c"}) == VALID


def test_schema_errors_name_their_pointer_and_keyword_in_the_validators_order() -> None:
    verdict = checker(tools={"weather": WEATHER}).check_call("weather", {"city": "", "unit": "k", "x": 1})
    assert verdict == Verdict(
        valid=False,
        reason="schema",
        errors=[
            CheckError(pointer="/city", keyword="minLength", message='"" is shorter than 1 character'),
            CheckError(pointer="/unit", keyword="enum", message='"k" is not one of "c" or "f"'),
            CheckError(
                pointer="",
                keyword="additionalProperties",
                message="Additional properties are not allowed ('x' was unexpected)",
            ),
        ],
    )


def test_at_most_five_errors_and_the_rest_is_said() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8)}}
    verdict = checker(tools={"t": schema}).check_call("t", {f"p{i}": "x" for i in range(8)})
    assert [e.pointer for e in verdict.errors] == ["/p0", "/p1", "/p2", "/p3", "/p4"] and verdict.more_errors


def test_pointers_escape_tilde_and_slash() -> None:
    schema = {"type": "object", "properties": {"a/b~c": {"type": "integer"}}}
    verdict = checker(tools={"t": schema}).check_call("t", {"a/b~c": "x"})
    assert verdict.errors[0].pointer == "/a~1b~0c"


def test_long_messages_are_cut() -> None:
    verdict = checker(tools={"t": {"type": "object", "properties": {"s": {"type": "integer"}}}}).check_call(
        "t", {"s": "x" * 1000}
    )
    message = verdict.errors[0].message
    assert len(message) == 200 and message.endswith("…")


def test_an_undeclared_tool() -> None:
    verdict = checker(tools={"weather": WEATHER}).check_call("shell", {"cmd": "rm -rf /"})
    assert verdict == Verdict(
        valid=False,
        reason="undeclared_tool",
        errors=[CheckError(pointer="", keyword="", message="'shell' is not among the job's tools")],
    )


def test_tool_choice_none_and_named() -> None:
    none = checker(tools={"weather": WEATHER}, tool_choice="none").check_call("weather", {"city": "Oslo"})
    assert none.reason == "tool_choice" and none.errors[0].message == 'tool_choice is "none": no tool may be called'
    tools = {"weather": WEATHER, "time": {"type": "object"}}
    named = checker(tools=tools, tool_choice=NamedToolChoice(name="time")).check_call("weather", {"city": "Oslo"})
    assert named.reason == "tool_choice" and named.errors[0].message == "tool_choice names 'time', not 'weather'"
    assert checker(tools=tools, tool_choice=NamedToolChoice(name="time")).check_call("time", {}) == VALID
    assert checker(tools=tools, tool_choice="required").check_call("time", {}) == VALID


def test_answers_parse_once_and_are_never_repaired() -> None:
    c = checker(answer=WEATHER)
    assert c.check_answer(' {"city": "Oslo"}\n') == VALID
    cut = c.check_answer('{"city": "Os')
    assert cut.reason == "not_json" and cut.errors[0].message.startswith("the answer is not JSON (")
    assert c.check_answer("").reason == "not_json"
    assert c.check_answer('{"city": 3}').errors[0] == CheckError(
        pointer="/city", keyword="type", message='3 is not of type "string"'
    )
    deep = "[" * 2000 + "]" * 2000
    assert c.check_answer(deep).errors[0].message == "the answer nests deeper than the JSON decoder's limit"


def test_a_value_too_deep_to_describe_is_invalid_all_the_same() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    value: Any = 1
    for _ in range(400):
        value = [value]
    verdict = checker(tools={"t": schema}).check_call("t", {"a": value})
    assert verdict == Verdict(
        valid=False,
        reason="schema",
        errors=[CheckError(pointer="", keyword="", message="the value nests too deeply for its errors to be listed")],
    )


def test_big_integers_and_integral_floats() -> None:
    c = checker(tools={"t": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}})
    assert c.check_call("t", {"n": 10**30}).errors[0].keyword == "maximum"
    assert c.check_call("t", {"n": 3.0}) == VALID


def test_counts() -> None:
    c = checker(tools={"weather": WEATHER})
    c.check_call("weather", {"city": "a"})
    c.check_call("nope", {})
    assert (c.calls, c.invalid_calls) == (2, 1)


# -- schemas at intake, the cache ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "objectx"}, 'not a valid JSON Schema: "objectx" is not valid under any of the schemas listed'),
        ({"$schema": "https://example.com/mine"}, "not a valid JSON Schema: Unknown meta-schema"),
        ({"$ref": "https://example.com/s.json"}, "not a valid JSON Schema: Resource 'https://example.com/s.json'"),
        ({"$ref": "#/$defs/missing"}, "not a valid JSON Schema: Pointer '/$defs/missing' does not exist"),
        ({"type": "string", "pattern": "("}, 'not a valid JSON Schema: "(" is not a "regex"'),
    ],
)
def test_bad_schemas_are_one_line_naming_the_tool(schema: dict[str, Any], why: str) -> None:
    problem = schema_problem(CheckSpec(tools={"t": {"type": "object"}, "bad": schema}), ValidatorCache())
    assert problem is not None and problem.startswith(f"tool 'bad': {why}") and "\n" not in problem


def test_remote_references_are_never_fetched() -> None:
    problem = schema_problem(CheckSpec(answer={"$ref": "http://127.0.0.1:9/s.json"}), ValidatorCache())
    assert problem is not None and problem.startswith("response_format: not a valid JSON Schema: Resource")
    assert "Retrieval is disabled" in problem


def test_too_deep_and_too_large() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    assert schema_problem(CheckSpec(tools={"t": deep}), ValidatorCache()) == (
        f"tool 't': the schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
    )
    large = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    problem = schema_problem(CheckSpec(answer=large), ValidatorCache())
    assert problem is not None and problem.startswith("response_format: the schema is ")
    assert problem.endswith(f"bytes, over the limit of {MAX_SCHEMA_BYTES}")


def test_drafts_follow_dollar_schema_else_2020_12() -> None:
    # draft 4's boolean exclusiveMinimum, 2020-12's prefixItems: each read by its own draft.
    d4 = {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 1, "exclusiveMinimum": True}
    assert checker(answer=d4).check_answer("1").errors[0].keyword in ("minimum", "exclusiveMinimum")
    assert checker(answer=d4).check_answer("2") == VALID
    tuple_schema = {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}
    assert checker(answer=tuple_schema).check_answer("[1]") == VALID
    assert not checker(answer=tuple_schema).check_answer("[1, 2]").valid


def test_formats_are_annotations() -> None:
    assert checker(answer={"type": "string", "format": "email"}).check_answer('"not an address"') == VALID


def test_the_cache_is_bounded_and_keyed_by_the_canonical_schema() -> None:
    cache = ValidatorCache(max_entries=2)
    a = cache.get({"type": "object", "required": ["x"]})
    assert cache.get({"required": ["x"], "type": "object"}) is a  # same schema, keys in another order
    cache.get({"type": "string"})
    cache.get({"type": "integer"})  # evicts the least recently used: the first
    assert cache.statistics() == {"entries": 2, "hits": 1, "misses": 3}
    assert cache.get({"type": "object", "required": ["x"]}) is not a


def test_compile_refuses_what_intake_refuses() -> None:
    with pytest.raises(SchemaProblem, match=r"^tool 'bad': not a valid JSON Schema"):
        Checker.compile(CheckSpec(tools={"bad": {"type": 3}}), "record", ValidatorCache())


def test_validator_version() -> None:
    assert validator_version().startswith("jsonschema-rs ")


# -- the spec -----------------------------------------------------------------------------------------------


def _request(**fields: Any) -> Any:
    return decode_request(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **fields}))


def test_checks_for_a_request() -> None:
    assert checks_for(_request()) is None
    spec = checks_for(_request(tools=[{"name": "weather", "parameters": WEATHER}], response_format={"schema": WEATHER}))
    assert spec == CheckSpec(tools={"weather": WEATHER}, answer=WEATHER)
    assert decode_checks(encode_checks(spec)) == spec  # type: ignore[arg-type]
    assert checks_for(_request(tool_choice="none")) == CheckSpec(tools={}, tool_choice="none")
    assert encode_checks(CheckSpec(answer={"b": 1, "a": 2})) == b'{"answer":{"a":2,"b":1}}'


# -- in the machine -------------------------------------------------------------------------------------------


def _call_stream(m: StreamMachine, calls: list[tuple[str, str]], stop: str = "tool_use") -> list[Any]:
    out = m.process(Start(model="m"), ts=0, raw=[1])
    for i, (name, args) in enumerate(calls):
        out += m.process(Open(key=i, kind="tool_call", name=name, call_id=f"c{i}"), ts=0, raw=[2])
        out += m.process(Append(key=i, kind="json_text", text=args), ts=0, raw=[3])
        out += m.process(Close(key=i), ts=0, raw=[4])
        if m.terminal:
            return out
    out += m.process(Finish(stop_reason=stop, provider_stop_reason="x"), ts=0, raw=[5])  # type: ignore[arg-type]
    return out


def _machine(policy: str = "record", **spec: Any) -> StreamMachine:
    return StreamMachine(replace(info("anthropic"), checks=checker(policy, **spec)))


def test_parallel_calls_one_invalid_under_record() -> None:
    m = _machine(tools={"weather": WEATHER})
    events = _call_stream(m, [("weather", '{"city":"Oslo"}'), ("weather", '{"city":""}')])
    check_invariants(events)
    assert isinstance(events[0], StreamStart) and events[0].checks == "record"
    stops = [e for e in events if isinstance(e, BlockStop)]
    assert stops[0].verdict == VALID and stops[1].verdict.reason == "schema"  # type: ignore[union-attr]
    result = m.result()
    assert result.status == "completed" and result.invalid_calls == 1
    assert [c.call_id for c in result.tool_calls] == ["c0"] and [c.call_id for c in result.invalid_tool_calls] == ["c1"]
    assert [b.call_id for b in result.as_message().content if hasattr(b, "call_id")] == ["c0", "c1"]  # type: ignore[union-attr]


def test_parallel_calls_one_invalid_under_fail() -> None:
    m = _machine("fail", tools={"weather": WEATHER})
    events = _call_stream(m, [("weather", '{"city":"Oslo"}'), ("shell", "{}"), ("weather", '{"city":"X"}')])
    check_invariants(events)
    assert briefs(events) == [
        "start m checks=fail",
        "open 0 tool_call weather c0",
        """delta 0 json_text '{"city":"Oslo"}'""",
        'stop 0 {"city":"Oslo"} verdict=valid',
        "open 1 tool_call shell c1",
        "delta 1 json_text '{}'",
        "stop 1 {} verdict=undeclared_tool",
        "failed invalid_output None retryable=False",
    ]
    last = events[-1]
    assert isinstance(last, StreamError) and last.error.category == "invalid_output" and not last.error.retryable
    assert last.error.block_index == 1
    assert last.error.message == "tool call shell (block 1): 'shell' is not among the job's tools"
    assert isinstance(events[-2], BlockStop) and events[-2].verdict.reason == "undeclared_tool"  # type: ignore[union-attr]
    assert m.terminal and m.state.value == "failed" and m.result().invalid_calls == 1


def test_schema_failure_message_names_pointer_and_keyword_only() -> None:
    m = _machine("fail", tools={"weather": WEATHER})
    events = _call_stream(m, [("weather", '{"city":"Oslo","unit":"kelvin"}')])
    assert isinstance(events[-1], StreamError)
    assert events[-1].error.message == "tool call weather (block 0): does not match its schema at /unit (enum)"


def _answer_stream(m: StreamMachine, text: str, stop: str = "stop") -> list[Any]:
    out = m.process(Start(model="m"), ts=0, raw=[1])
    out += m.process(Open(key="t", kind="text"), ts=0, raw=[2])
    out += m.process(Append(key="t", kind="text", text=text), ts=0, raw=[2])
    out += m.process(Close(key="t"), ts=0, raw=[3])
    out += m.process(Finish(stop_reason=stop, provider_stop_reason="x"), ts=0, raw=[4])  # type: ignore[arg-type]
    return out


def test_answers_under_both_policies() -> None:
    ok = _answer_stream(_machine(answer=WEATHER), '{"city":"Oslo"}')
    assert isinstance(ok[-1], StreamDone) and ok[-1].answer == VALID
    for policy in ("record", "fail"):
        m = _machine(policy, answer=WEATHER)
        events = _answer_stream(m, '{"city":"Oslo","days":99}')
        check_invariants(events)
        term = events[-1]
        assert term.answer.errors[0].pointer == "/days"  # type: ignore[union-attr]
        assert m.result().answer == term.answer  # type: ignore[union-attr]
        if policy == "record":
            assert isinstance(term, StreamDone) and m.result().status == "completed"
        else:
            assert isinstance(term, StreamError) and term.error.category == "invalid_output"
            assert term.error.message == "the answer: does not match its schema at /days (maximum)"


def test_a_cut_answer_is_checked_and_a_refused_one_is_not() -> None:
    cut = _answer_stream(_machine(answer=WEATHER), '{"city":"Os', "length")
    assert cut[-1].answer.reason == "not_json"  # type: ignore[union-attr]
    filtered = _answer_stream(_machine(answer=WEATHER), "sorry", "content_filter")
    assert filtered[-1].answer is msgspec.UNSET  # type: ignore[union-attr]


def test_a_failed_stream_is_never_checked_as_an_answer() -> None:
    m = _machine("fail", answer=WEATHER)
    m.process(Start(model="m"), ts=0)
    m.process(Open(key="t", kind="text"), ts=0)
    m.process(Append(key="t", kind="text", text='{"city":"Oslo"}'), ts=0)
    term = m.interrupt("transport", "cut", ts=0)[-1]
    assert isinstance(term, StreamError) and term.answer is msgspec.UNSET and m.result().answer is None


def test_tool_turns_are_not_answers() -> None:
    m = _machine(tools={"weather": WEATHER}, answer=WEATHER)
    events = _call_stream(m, [("weather", '{"city":"Oslo"}')], stop="stop")  # upgraded to tool_use
    assert isinstance(events[-1], StreamDone) and events[-1].stop_reason == "tool_use"
    assert events[-1].answer is msgspec.UNSET


def test_no_checks_no_verdicts() -> None:
    m = StreamMachine(info("anthropic"))
    events = _call_stream(m, [("anything", '{"x":1}')])
    assert events[0].checks is msgspec.UNSET and all(
        getattr(e, "verdict", msgspec.UNSET) is msgspec.UNSET for e in events
    )
    assert m.result().invalid_calls is None


def test_deeply_nested_arguments_are_a_protocol_error_not_a_crash() -> None:
    m = _machine(tools={"t": {"type": "object"}})
    with pytest.raises(ProviderProtocolError, match="nest deeper than the JSON decoder's limit") as caught:
        _call_stream(m, [("t", '{"a":' + "[" * 2000 + "]" * 2000 + "}")])
    assert caught.value.block_index == 0  # the Normalizer ends the stream with it: a protocol failure


# -- the chosen validator against the reference implementation -------------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.sampled_from([0.5, -1.5, 2.0]),
    st.sampled_from(["", "a", "ab", "abc", "xyz"]),
)
_KEYS = st.sampled_from(["a", "b", "c"])
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=8,
)
_TYPES = st.sampled_from(["null", "boolean", "integer", "number", "string", "array", "object"])


def _leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda t: {"type": t}, _TYPES),
        st.builds(lambda ts: {"type": ts}, st.lists(_TYPES, min_size=1, max_size=3, unique=True)),
        st.builds(lambda vs: {"enum": vs}, st.lists(_SCALARS, min_size=1, max_size=3)),
        st.builds(lambda v: {"const": v}, _SCALARS),
        st.builds(lambda n: {"minimum": n}, st.integers(-3, 3)),
        st.builds(lambda n: {"exclusiveMaximum": n}, st.integers(-3, 3)),
        st.builds(lambda n: {"minLength": n}, st.integers(0, 3)),
        st.builds(lambda n: {"maxItems": n}, st.integers(0, 2)),
        st.just({"uniqueItems": True}),
        st.just({"$ref": "#/$defs/name"}),
        st.just({}),
    )


_SCHEMAS = st.recursive(
    _leaf_schemas(),
    lambda inner: st.one_of(
        st.builds(
            lambda props, req, extra: (
                {"type": "object", "properties": props, "required": req}
                | ({} if extra is None else {"additionalProperties": extra})
            ),
            st.dictionaries(_KEYS, inner, max_size=3),
            st.lists(_KEYS, max_size=2, unique=True),
            st.one_of(st.none(), st.booleans(), inner),
        ),
        st.builds(lambda s: {"type": "array", "items": s}, inner),
        st.builds(lambda ss: {"anyOf": ss}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda ss: {"oneOf": ss}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda ss: {"allOf": ss}, st.lists(inner, min_size=1, max_size=2)),
        st.builds(lambda s: {"not": s}, inner),
    ),
    max_leaves=6,
)
_DEFS = {"name": {"type": "string", "minLength": 2}}


def _reference(schema: dict[str, Any], value: Any) -> tuple[bool, set[tuple[str, str]]]:
    ref = jsonschema.Draft202012Validator(schema, registry=Registry())
    errors = {("".join(f"/{p}" for p in e.absolute_path), str(e.validator)) for e in ref.iter_errors(value)}
    return ref.is_valid(value), errors


def test_a_present_property_is_never_reported_missing() -> None:
    """jsonschema-rs also reports ``required`` for a present property that ``additionalProperties: false``
    refuses; the verdict names only what the reference names (found by the property below)."""
    schema = {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}
    c = Checker.compile(CheckSpec(answer=schema), "record", ValidatorCache())
    verdict = c.check_answer('{"a": null}')
    assert not verdict.valid
    assert [(e.pointer, e.keyword) for e in verdict.errors] == [("", "additionalProperties")]
    assert _reference(schema, {"a": None}) == (False, {("", "additionalProperties")})
    missing = c.check_answer("{}")
    assert [(e.pointer, e.keyword) for e in missing.errors] == [("", "required")]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_SCHEMAS, value=_VALUES)
def test_verdicts_agree_with_the_reference_implementation(schema: dict[str, Any], value: Any) -> None:
    """jsonschema-rs (the validator) and python-jsonschema (the reference) agree on validity, and on where
    and by which keyword a value fails, over generated 2020-12 schemas (types, enums, consts, bounds, nested
    objects and arrays, anyOf / oneOf / allOf / not, a $ref) and instances."""
    schema = {**schema, "$defs": _DEFS}
    c = Checker.compile(CheckSpec(answer=schema), "record", ValidatorCache())
    verdict = c.check_answer(msgspec.json.encode(value).decode())
    valid, errors = _reference(schema, value)
    assert verdict.valid is valid
    if not verdict.more_errors:
        assert {(e.pointer, e.keyword) for e in verdict.errors} == errors

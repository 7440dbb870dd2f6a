"""Each vocabulary is written once: the runtime tuples are the Literals' own members, the request states
nest (failed ⊂ terminal ⊂ request), and the published schema lists the same members."""

from __future__ import annotations

from typing import get_args, get_type_hints

import pytest

from sluice.schemas import events as ev
from sluice.schemas import states
from sluice.schemas.jsonschema import contract_schema
from sluice.schemas.result import Result, ResultBlock
from sluice.schemas.status import Status

PAIRS = [
    (ev.BLOCK_KINDS, ev.BlockKind),
    (ev.DELTA_KINDS, ev.DeltaKind),
    (ev.STOP_REASONS, ev.StopReason),
    (ev.VISIBILITIES, ev.Visibility),
    (ev.ARGUMENTS_ERRORS, ev.ArgumentsError),
    (ev.ERROR_CATEGORIES, ev.ErrorCategory),
    (states.REQUEST_STATES, states.RequestState),
]


@pytest.mark.parametrize(("values", "literal"), PAIRS)
def test_each_tuple_is_its_literal(values: tuple[str, ...], literal: object) -> None:
    assert values == get_args(literal) and len(set(values)) == len(values)


def test_the_request_states_nest() -> None:
    assert states.REQUEST_STATES == ("queued", "running", "completed", "failed", "interrupted")
    assert {"completed", "failed", "interrupted"} == states.TERMINAL_STATES
    assert set(get_args(states.FailedState)) == states.TERMINAL_STATES - {"completed"}
    assert set(get_args(states.ResultStatus)) == states.TERMINAL_STATES | {"running"}


def test_events_results_and_status_records_use_the_state_vocabulary() -> None:
    assert get_type_hints(ev.StreamError)["status"] == states.FailedState
    assert get_type_hints(Result)["status"] == states.ResultStatus
    assert get_type_hints(Status)["state"] == states.RequestState
    done = get_args(get_type_hints(ev.StreamDone)["status"])
    assert set(done) | set(get_args(states.FailedState)) == states.TERMINAL_STATES


def test_every_event_class_has_its_tag() -> None:
    assert set(ev.EVENT_TAGS) == set(get_args(ev.Event))
    assert tuple(ev.EVENT_TAGS.values()) == ev.EVENT_TYPES
    assert ev.EVENT_TAGS[ev.BlockDelta] == "block.delta" and ev.EVENT_TAGS[ev.StreamError] == "stream.error"


def _enums(node: object) -> list[list[str]]:
    if isinstance(node, dict):
        found = [node["enum"]] if "enum" in node else []
        return found + [e for v in node.values() for e in _enums(v)]
    if isinstance(node, list):
        return [e for v in node for e in _enums(v)]
    return []


@pytest.mark.parametrize(("values", "literal"), PAIRS[:-1])
def test_the_published_schema_lists_each_vocabulary(values: tuple[str, ...], literal: object) -> None:
    assert sorted(values) in _enums(contract_schema())


def test_result_blocks_share_the_contracts_block_vocabularies() -> None:
    hints = get_type_hints(ResultBlock)
    assert hints["kind"] == ev.BlockKind
    assert hints["visibility"] == ev.Visibility | None


def test_every_block_kind_takes_some_delta_kinds_and_every_delta_kind_has_a_block() -> None:
    assert tuple(ev.BLOCK_DELTA_KINDS) == ev.BLOCK_KINDS
    assert set().union(*ev.BLOCK_DELTA_KINDS.values()) == set(ev.DELTA_KINDS)
    assert all(ev.BLOCK_DELTA_KINDS.values())

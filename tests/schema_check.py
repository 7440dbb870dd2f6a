"""Every contract event the suite produces is validated against the published JSON Schema
(``schemas/contract.schema.json``) with a real validator, so the schema and the code cannot drift.

Rule: installed once per session by ``tests/conftest.py`` around the two places every event passes: the
state machine that produces them (``StreamMachine.process`` / ``fail`` / ``interrupt``, and its
assembled ``result``) and the independent ``ContractChecker`` that reads them back (integration tests
check what workers stored in Redis with it). A document is validated once; identical ones (the same
transcript under many chunkings) are remembered by their encoded bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from sluice.normalizer.machine import StreamMachine
from sluice.schemas.events import Event, encode_event
from sluice.schemas.invariants import ContractChecker
from sluice.schemas.result import Result

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "contract.schema.json"
_SCHEMA: dict[str, Any] = msgspec.json.decode(SCHEMA_PATH.read_bytes())
_EVENTS = jsonschema.Draft202012Validator(_SCHEMA)  # the document as published: one event
_RESULTS = jsonschema.Draft202012Validator(
    {"$schema": _SCHEMA["$schema"], "$defs": _SCHEMA["$defs"], "$ref": "#/$defs/Result"}
)
_seen: set[bytes] = set()


class SchemaMismatch(AssertionError):
    pass


def validate_event(event: Event) -> None:
    data = encode_event(event)
    if data not in _seen:
        _check(_EVENTS, data)
        _seen.add(data)


def validate_result(result: Result) -> None:
    data = b"R" + msgspec.json.encode(result)
    if data not in _seen:
        _check(_RESULTS, data[1:])
        _seen.add(data)


def _check(validator: jsonschema.Draft202012Validator, data: bytes) -> None:
    error = jsonschema.exceptions.best_match(validator.iter_errors(msgspec.json.decode(data)))
    if error is not None:
        raise SchemaMismatch(f"{data.decode()} does not match the published schema: {error.message}")


def _checking_events(method: Callable[..., list[Event]]) -> Callable[..., list[Event]]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> list[Event]:
        events = method(*args, **kwargs)
        for ev in events:
            validate_event(ev)
        return events

    return wrapper


def _checking_result(method: Callable[..., Result]) -> Callable[..., Result]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Result:
        result = method(*args, **kwargs)
        validate_result(result)
        return result

    return wrapper


def _checking_checker(method: Callable[[ContractChecker, Event], None]) -> Callable[[ContractChecker, Event], None]:
    @functools.wraps(method)
    def wrapper(self: ContractChecker, event: Event) -> None:
        validate_event(event)
        method(self, event)

    return wrapper


def install(mp: pytest.MonkeyPatch) -> None:
    for name in ("process", "fail", "interrupt"):
        mp.setattr(StreamMachine, name, _checking_events(getattr(StreamMachine, name)))
    mp.setattr(StreamMachine, "result", _checking_result(StreamMachine.result))
    mp.setattr(ContractChecker, "process", _checking_checker(ContractChecker.process))

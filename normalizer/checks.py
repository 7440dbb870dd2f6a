"""Output checks: a tool call held against the job's declared tools, its ``tool_choice`` and the tool's JSON
Schema at its ``block.stop``; a structured answer against its schema when the stream completes.

Rule: a verdict is a pure function of the declarations (``CheckSpec``), the parsed value and the validator
(jsonschema-rs, chosen by measurement: docs/benchmarks.md#tool-argument-validation), so ``sluice audit``
recomputes it from the raw log and the stored spec. The validator stays pure here: every schema is compiled
``offline`` (a ``$ref`` outside the schema is refused at intake, never fetched), formats are annotations
(not asserted: JSON Schema 2020-12's default, and what every dialect's constrained decoding leaves open)
and no clock or randomness enters. Nothing is ever repaired, coerced or defaulted: a value is valid or its
verdict says why not.

Schema flavour, explicitly: the request shape's schemas are JSON Schema, and every dialect's builder sends
them where the provider reads JSON Schema (OpenAI ``parameters`` and ``json_schema.schema``, Anthropic
``input_schema`` and ``output_config.format.schema``, Gemini ``parametersJsonSchema`` and
``responseJsonSchema``, never its OpenAPI-flavoured ``parameters`` / ``responseSchema``, Bedrock
``inputSchema.json`` and ``textFormat``'s schema). So one rule serves all: the draft a schema's ``$schema``
names (4, 6, 7, 2019-09, 2020-12), else 2020-12. OpenAI's strict mode accepts a subset of 2020-12, which
validates the same way; keywords outside a provider's subset are the provider's to refuse (a 400 at the
request), not sluice's.

Intake (``schema_problem``): a schema that is not valid JSON Schema for its draft, names an unknown
``$schema``, holds a ``$ref`` the validator cannot resolve offline, nests deeper than ``MAX_SCHEMA_DEPTH``
or encodes to more than ``MAX_SCHEMA_BYTES`` is bad input: one line naming the tool (or the answer) and the
reason. Compiled validators are cached by the sha256 of the schema's canonical JSON (``ValidatorCache``,
bounded, least recently used out first): the cache is an object the caller owns (the worker one per
process), not module state.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
import msgspec

from sluice.schemas.checks import CheckSpec
from sluice.schemas.events import (
    MAX_CHECK_MESSAGE,
    MAX_VERDICT_ERRORS,
    CheckError,
    CheckPolicy,
    CheckReason,
    Verdict,
)
from sluice.schemas.request import NamedToolChoice

__all__ = [
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "VALID",
    "VALIDATOR",
    "Checker",
    "SchemaProblem",
    "ValidatorCache",
    "schema_problem",
    "validator_version",
]

MAX_SCHEMA_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 32
DEFAULT_CACHE_ENTRIES = 512
VALIDATOR = "jsonschema-rs"
VALID = Verdict(valid=True)

_CANONICAL = msgspec.json.Encoder(order="sorted")
_ANY_JSON = msgspec.json.Decoder()


def validator_version() -> str:
    """``jsonschema-rs <version>``: recorded with each checked request, shown by the audit beside its own."""
    from importlib.metadata import version

    return f"{VALIDATOR} {version('jsonschema_rs')}"


class SchemaProblem(ValueError):
    """A schema the validator cannot take; the message says why, in one line."""


def _depth(value: Any) -> int:
    """Nesting of JSON containers (a scalar is 0), without recursion: a hostile schema cannot blow the stack."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            items: Any = node.values()
        elif isinstance(node, list):
            items = node
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, level) for child in items)
    return deepest


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return _bounded(line)


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_CHECK_MESSAGE else text[: MAX_CHECK_MESSAGE - 1] + "…"


class ValidatorCache:
    """Compiled validators by the sha256 of their schema's canonical JSON; at most ``max_entries``."""

    def __init__(self, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._compiled: OrderedDict[str, jsonschema_rs.Validator] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, schema: dict[str, Any]) -> jsonschema_rs.Validator:
        """The compiled validator of ``schema``. Raises ``SchemaProblem`` for one it cannot take."""
        text = _CANONICAL.encode(schema)
        if len(text) > MAX_SCHEMA_BYTES:
            raise SchemaProblem(f"the schema is {len(text)} bytes, over the limit of {MAX_SCHEMA_BYTES}")
        key = hashlib.sha256(text).hexdigest()
        found = self._compiled.get(key)
        if found is not None:
            self.hits += 1
            self._compiled.move_to_end(key)
            return found
        self.misses += 1
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise SchemaProblem(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            # offline: a reference outside the document is refused, never retrieved (no IO in the core);
            # validate_formats=False: formats are annotations, as 2020-12 says, for every draft.
            compiled = jsonschema_rs.validator_for(schema, offline=True, validate_formats=False)
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
            raise SchemaProblem(f"not a valid JSON Schema: {_first_line(str(exc))}") from None
        self._compiled[key] = compiled
        while len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
        return compiled

    def statistics(self) -> dict[str, int]:
        return {"entries": len(self._compiled), "hits": self.hits, "misses": self.misses}


def schema_problem(spec: CheckSpec | None, cache: ValidatorCache) -> str | None:
    """Why a request's schemas cannot be checked (one line naming the tool or the answer), or None. Compiles
    each into ``cache``, so the attempts find them there."""
    if spec is None:
        return None
    for name, schema in (spec.tools or {}).items():
        try:
            cache.get(schema)
        except SchemaProblem as exc:
            return f"tool {name!r}: {exc}"
    if spec.answer is not None:
        try:
            cache.get(spec.answer)
        except SchemaProblem as exc:
            return f"response_format: {exc}"
    return None


def _pointer(path: list[str | int]) -> str:
    """RFC 6901: each segment with ``~`` as ``~0`` and ``/`` as ``~1``."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _errors(validator: jsonschema_rs.Validator, value: Any) -> Iterator[CheckError]:
    try:
        for err in validator.iter_errors(value):
            if _spurious_required(err):
                continue
            keyword = next((s for s in reversed(err.schema_path) if isinstance(s, str)), "")
            yield CheckError(pointer=_pointer(err.instance_path), keyword=keyword, message=_bounded(err.message))
    except ValueError:
        # The validator cannot describe a value this deep (its error reports copy the value): the value is
        # invalid all the same, and the verdict says so without listing where.
        yield CheckError(pointer="", keyword="", message="the value nests too deeply for its errors to be listed")


def _spurious_required(err: jsonschema_rs.ValidationError) -> bool:
    """A ``required`` error for a property the object has. jsonschema-rs 0.61 reports one beside
    ``additionalProperties: false`` when ``properties`` does not name the property (the value is invalid all
    the same, by ``additionalProperties``); the reference reports only that, and so does the verdict."""
    kind = err.kind
    return (
        isinstance(kind, jsonschema_rs.ValidationErrorKind.Required)
        and isinstance(err.instance, dict)
        and kind.property in err.instance
    )


def _schema_verdict(validator: jsonschema_rs.Validator, value: Any) -> Verdict:
    if validator.is_valid(value):
        return VALID
    errors: list[CheckError] = []
    more = False
    for err in _errors(validator, value):
        if len(errors) == MAX_VERDICT_ERRORS:
            more = True
            break
        errors.append(err)
    return Verdict(valid=False, reason="schema", errors=errors, more_errors=more)


def _invalid(reason: CheckReason, message: str) -> Verdict:
    return Verdict(valid=False, reason=reason, errors=[CheckError(pointer="", keyword="", message=_bounded(message))])


@dataclass(slots=True)
class Checker:
    """One attempt's checks: the spec's schemas compiled, and the attempt's policy."""

    spec: CheckSpec
    policy: CheckPolicy
    _tools: dict[str, jsonschema_rs.Validator] | None = None
    _answer: jsonschema_rs.Validator | None = None
    calls: int = field(default=0)
    invalid_calls: int = field(default=0)

    @classmethod
    def compile(cls, spec: CheckSpec, policy: CheckPolicy, cache: ValidatorCache) -> Checker:
        """Raises ``SchemaProblem`` (naming the tool or the answer) for a schema that cannot be compiled."""
        problem = schema_problem(spec, cache)
        if problem is not None:
            raise SchemaProblem(problem)
        tools = {name: cache.get(schema) for name, schema in spec.tools.items()} if spec.tools is not None else None
        answer = cache.get(spec.answer) if spec.answer is not None else None
        return cls(spec, policy, tools, answer)

    @property
    def checks_calls(self) -> bool:
        return self._tools is not None

    @property
    def checks_answer(self) -> bool:
        return self._answer is not None

    def check_call(self, name: str, arguments: dict[str, Any]) -> Verdict:
        """A tool call with parsed arguments: its name against the declared tools and the tool_choice, then
        its arguments against the tool's schema."""
        assert self._tools is not None
        self.calls += 1
        verdict = self._call(name, arguments, self._tools)
        self.invalid_calls += not verdict.valid
        return verdict

    def _call(self, name: str, arguments: dict[str, Any], tools: dict[str, jsonschema_rs.Validator]) -> Verdict:
        validator = tools.get(name)
        if validator is None:
            return _invalid("undeclared_tool", f"{name!r} is not among the job's tools")
        choice = self.spec.tool_choice
        if choice == "none":
            return _invalid("tool_choice", 'tool_choice is "none": no tool may be called')
        if isinstance(choice, NamedToolChoice) and choice.name != name:
            return _invalid("tool_choice", f"tool_choice names {choice.name!r}, not {name!r}")
        return _schema_verdict(validator, arguments)

    def check_answer(self, text: str) -> Verdict:
        """The final answer's text, parsed once, against the answer's schema."""
        assert self._answer is not None
        try:
            value = _ANY_JSON.decode(text)
        except msgspec.DecodeError as exc:
            return _invalid("not_json", f"the answer is not JSON ({exc})")
        except RecursionError:
            return _invalid("not_json", "the answer nests deeper than the JSON decoder's limit")
        return _schema_verdict(self._answer, value)

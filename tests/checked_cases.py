"""The output-check cases every dialect's transcripts run under (contract 1.3): the declarations (a
``CheckSpec``) per case, and which transcript of each dialect each case reads.

Rule: the same declarations for every dialect, so each dialect's goldens
(``<transcript>.checked.json`` beside the transcript, one entry per ``<case>/<policy>``) show the same
verdicts where its wire format differs; ``python -m tests.regen_goldens`` drafts the goldens that are
missing, to be read against these tables before they are committed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from sluice.normalizer.checks import Checker, ValidatorCache
from sluice.normalizer.machine import StreamInfo
from sluice.schemas.checks import CheckSpec
from sluice.schemas.events import CHECK_POLICIES, CheckPolicy
from sluice.schemas.request import NamedToolChoice

__all__ = ["ANSWER_CASES", "CALLS", "CALL_CASES", "POLICIES", "body_path", "cases", "checked_info"]

TRANSCRIPTS = Path(__file__).parent / "fixtures" / "transcripts"

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Za-z_]+$"}},
    "required": ["tz"],
    "additionalProperties": False,
}
# Two errors for the weather call (a missing unit, a city longer than 3), one for the time call.
WEATHER_STRICT: dict[str, Any] = {
    **WEATHER,
    "properties": {**WEATHER["properties"], "city": {"type": "string", "maxLength": 3}},
    "required": ["city", "unit"],
}
TIME_NUMERIC: dict[str, Any] = {**TIME, "properties": {"tz": {"type": "integer"}}}
ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
    "required": ["city", "temp_c"],
    "additionalProperties": False,
}
ANSWER_MISMATCH: dict[str, Any] = {
    **ANSWER,
    "properties": {**ANSWER["properties"], "temp_c": {"type": "number", "maximum": 20}},
    "required": ["city", "temp_c", "wind"],
}

# The calls transcripts: get_weather {"city": "Paris"} and get_time {"tz": "Europe/Paris"} in one turn.
CALL_CASES: dict[str, CheckSpec] = {
    "valid": CheckSpec(tools={"get_weather": WEATHER, "get_time": TIME}),
    "schema_errors": CheckSpec(tools={"get_weather": WEATHER_STRICT, "get_time": TIME_NUMERIC}),
    "undeclared_tool": CheckSpec(tools={"get_weather": WEATHER}),
    "one_of_parallel_invalid": CheckSpec(tools={"get_weather": WEATHER_STRICT, "get_time": TIME}),
    "tool_choice_named": CheckSpec(
        tools={"get_weather": WEATHER, "get_time": TIME}, tool_choice=NamedToolChoice(name="get_weather")
    ),
}
# The answer transcripts: the text {"city": "Paris", "temp_c": 21} in three deltas.
ANSWER_CASES: dict[str, CheckSpec] = {
    "answer_matches": CheckSpec(answer=ANSWER),
    "answer_mismatch": CheckSpec(answer=ANSWER_MISMATCH),
}
CALLS: dict[str, str] = {
    "anthropic": "parallel_weather_time",
    "openai-chat": "parallel_weather_time",
    "openai-responses": "parallel_function_calls",
    "gemini": "parallel_weather_time",
    "bedrock-converse": "parallel_weather_time",
}
POLICIES: tuple[CheckPolicy, ...] = CHECK_POLICIES


def cases(dialect: str) -> list[tuple[str, str, CheckSpec]]:
    """(transcript, case, spec) of one dialect."""
    return [(CALLS[dialect], name, spec) for name, spec in CALL_CASES.items()] + [
        ("json_answer", name, spec) for name, spec in ANSWER_CASES.items()
    ]


def body_path(dialect: str, transcript: str) -> Path:
    suffix = ".eventstream" if dialect == "bedrock-converse" else ".sse"
    return TRANSCRIPTS / dialect / f"{transcript}{suffix}"


def checked_info(base: StreamInfo, spec: CheckSpec, policy: CheckPolicy) -> StreamInfo:
    return replace(base, checks=Checker.compile(spec, policy, ValidatorCache()))

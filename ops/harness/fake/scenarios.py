"""The fake provider's scenario language: what one request asks the fake provider to do.

Rule: the scenario is the requested model name (the body's ``model``, or the URL path for Gemini), so
any client that can choose a model can choose a scenario and no test needs a side channel:

- ``transcript:<name>[;key=value...]`` serves ``<examples>/<dialect>/<name>.sse`` byte for byte;
- ``synthetic[;key=value...]`` generates a stream (seeded: the same string renders the same bytes);
- ``scenario-<base64url of one of the above>`` is the same scenario, spelled with only the characters a
  Gemini model name may carry in its URL path (``encode_scenario`` builds it);
- any other model name is the default synthetic stream, reported under that model name.

Keys are listed in ``KEYS``; an unknown key, a bad value or a generator key on a transcript raises
``ScenarioError`` (the server answers 400 with the message). Parsing and generation are pure: the only
randomness is ``random.Random(seed)``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import random
import re
from dataclasses import dataclass
from typing import Literal, TypedDict
from urllib.parse import unquote

from sluice.harness.fake.render import (
    ERROR_KINDS,
    STAMP_PLACEHOLDER,
    Reasoning,
    Script,
    ScriptBlock,
    StopKind,
    Text,
    ToolCall,
)

__all__ = [
    "ENCODED_PREFIX",
    "GATE_NAME",
    "KEYS",
    "SCENARIO_HELP",
    "Scenario",
    "ScenarioError",
    "build_script",
    "decode_model",
    "encode_scenario",
    "parse_scenario",
]


class ScenarioError(ValueError):
    """The requested scenario cannot be served; the message says why (never includes secrets)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    raw: str
    kind: str  # "synthetic" | "transcript"
    transcript: str | None = None
    model: str | None = None  # the model name to report; None: the fake's own name
    # generator
    deltas: int | None = None
    words: tuple[int, int] = (1, 3)
    text: str | None = None
    tools: int = 0
    reasoning: int = 0
    stop: Literal["stop", "length"] | None = None  # default: tool_use when there are tools, else stop
    seed: int = 0
    stamp: bool = False
    # transport
    pace_ms: float = 0.0
    chunk: int = 0
    hold: str | None = None  # a stream waits before its response head until the gate of that name opens
    # faults
    reset: int | None = None
    stall_headers: bool = False
    first_byte_ms: float = 0.0
    byte_ms: float = 0.0
    status: int = 0
    retry_after: str | None = None
    times: int = 0  # 0: every request; K: only the first K requests with this exact scenario string
    malformed_json: int = 0
    invalid_utf8: int = 0
    endless_line: bool = False
    truncate_tool: bool = False
    error_after: int | None = None
    error: str = "overloaded"
    drop_terminal: bool = False
    bad_tool_json: bool = False

    @property
    def faulty(self) -> bool:
        return self != self.without_faults()

    def without_faults(self) -> Scenario:
        """The same stream served normally (what ``times=K`` serves after K requests)."""
        return dataclasses.replace(self, **_NO_FAULTS)


class _Faults(TypedDict):
    """The fault fields of ``Scenario`` (typed, so ``dataclasses.replace`` checks each value)."""

    reset: int | None
    stall_headers: bool
    first_byte_ms: float
    byte_ms: float
    status: int
    retry_after: str | None
    malformed_json: int
    invalid_utf8: int
    endless_line: bool
    truncate_tool: bool
    error_after: int | None
    drop_terminal: bool
    bad_tool_json: bool


_NO_FAULTS: _Faults = {
    "reset": None,
    "stall_headers": False,
    "first_byte_ms": 0.0,
    "byte_ms": 0.0,
    "status": 0,
    "retry_after": None,
    "malformed_json": 0,
    "invalid_utf8": 0,
    "endless_line": False,
    "truncate_tool": False,
    "error_after": None,
    "drop_terminal": False,
    "bad_tool_json": False,
}

_MAX_COUNT = 1_000_000

# Keys that only the generator understands; a transcript is served as recorded.
_GENERATOR_ONLY = {
    "deltas",
    "words",
    "text",
    "tools",
    "reasoning",
    "stop",
    "seed",
    "stamp",
    "truncate_tool",
    "bad_tool_json",
}
KEYS: tuple[str, ...] = (
    "deltas",
    "words",
    "text",
    "tools",
    "reasoning",
    "stop",
    "seed",
    "stamp",
    "id",
    "pace_ms",
    "chunk",
    "hold",
    "reset",
    "stall_headers",
    "first_byte_ms",
    "byte_ms",
    "status",
    "retry_after",
    "times",
    "malformed_json",
    "invalid_utf8",
    "endless_line",
    "truncate_tool",
    "error_after",
    "error",
    "drop_terminal",
    "bad_tool_json",
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
GATE_NAME = _NAME  # what hold=NAME accepts (the server's release endpoint checks the same)

# `sluice fake-provider --help` prints this; a test checks that it names every key in KEYS.
SCENARIO_HELP = f"""\
scenarios: the requested model name says what to serve (no side channel needed):
  transcript:NAME[;key=value...]   EXAMPLES/<dialect>/NAME.sse byte for byte (transport and fault keys apply)
  synthetic[;key=value...]         a generated stream; the same string renders the same bytes
  scenario-<base64url>             either of the above, spelled for a Gemini URL path
  anything else                    the default synthetic stream, reported under that model name

generator keys (synthetic only):
  deltas=N        text deltas (default 8)          words=A or A-B   words per delta (default 1-3)
  text=T          the text itself (%-encoded)      tools=N          tool calls after the text
  reasoning=N     reasoning deltas before it       stop=stop|length the stop reason (default: stop,
  seed=N          the generator's seed                              tool_use with tools)
  stamp=1         embed the send time (benchmarks) id=S             any value: a distinct string (for times=K)
  truncate_tool=1 end inside a tool's JSON         bad_tool_json=1  invalid tool-argument JSON
transport keys:
  pace_ms=X       milliseconds between events      chunk=N          write N bytes at a time
  hold=NAME       a stream is admitted, then waits (in flight, nothing sent) until gate NAME opens:
                  FakeProvider.release(NAME) or POST /_fake/release/NAME; an opened gate stays open
faults:
  reset=N         reset the connection after N events        stall_headers=1  never send response headers
  first_byte_ms=X wait before the first body byte            byte_ms=X        wait between bytes
  status=CODE     answer HTTP CODE (400-599) with the dialect's error body; retry_after=S adds Retry-After
  times=K         the faults apply to the first K requests with this exact string, then it streams normally
  malformed_json=N  the Nth event's JSON is broken             invalid_utf8=N  the Nth event has invalid UTF-8
  endless_line=1  one line that never ends                   drop_terminal=1  no terminal event, then EOF
  error_after=N   a mid-stream error event after N events; error={"|".join(ERROR_KINDS)} (default overloaded)

examples:
  synthetic;deltas=20;pace_ms=50           synthetic;tools=2;reasoning=3;seed=7
  synthetic;status=429;retry_after=1;times=2   transcript:hello;chunk=1   synthetic;error_after=3;error=rate_limit
"""


def _int(key: str, value: str, low: int = 0, high: int = _MAX_COUNT) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ScenarioError(f"{key}={value!r}: expected an integer") from None
    if not low <= n <= high:
        raise ScenarioError(f"{key}={n}: expected {low}..{high}")
    return n


def _ms(key: str, value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        raise ScenarioError(f"{key}={value!r}: expected a number of milliseconds") from None
    if not 0 <= n <= 3_600_000:
        raise ScenarioError(f"{key}={value}: expected 0..3600000 ms")
    return n


def _flag(key: str, value: str) -> bool:
    if value not in ("0", "1"):
        raise ScenarioError(f"{key}={value!r}: expected 0 or 1")
    return value == "1"


def _value(key: str, value: str) -> object:
    if key in ("deltas", "tools", "reasoning", "malformed_json", "invalid_utf8", "times", "seed"):
        return _int(key, value, high=2**63 if key == "seed" else _MAX_COUNT)
    if key in ("reset", "error_after"):
        return _int(key, value)
    if key == "chunk":
        return _int(key, value, 1, 1 << 24)
    if key in ("pace_ms", "first_byte_ms", "byte_ms"):
        return _ms(key, value)
    if key in ("stamp", "stall_headers", "endless_line", "truncate_tool", "drop_terminal", "bad_tool_json"):
        return _flag(key, value)
    if key == "words":
        low, sep, high = value.partition("-")
        a = _int(key, low, 1, 1000)
        b = _int(key, high, a, 1000) if sep else a
        return (a, b)
    if key == "text":
        return unquote(value)
    if key == "hold":
        if not _NAME.fullmatch(value):
            raise ScenarioError(f"hold={value!r}: a gate name of letters, digits, '_', '.', '-'")
        return value
    if key == "status":
        return _int(key, value, 400, 599)
    if key == "retry_after":
        try:
            if float(value) < 0:
                raise ValueError
        except ValueError:
            raise ScenarioError(f"retry_after={value!r}: expected seconds (a number >= 0)") from None
        return value
    if key == "stop":
        if value not in ("stop", "length"):
            raise ScenarioError(f"stop={value!r}: expected stop or length")
        return value
    if key == "error":
        if value not in ERROR_KINDS:
            raise ScenarioError(f"error={value!r}: expected one of {', '.join(ERROR_KINDS)}")
        return value
    raise AssertionError(key)  # pragma: no cover - every key in KEYS is handled above


ENCODED_PREFIX = "scenario-"


def encode_scenario(scenario: str) -> str:
    """The scenario as a model name of only ``[A-Za-z0-9_-]`` (what the Gemini path allows)."""
    return ENCODED_PREFIX + base64.urlsafe_b64encode(scenario.encode()).decode().rstrip("=")


def decode_model(model: str) -> str:
    """The scenario string a requested model name stands for. Raises ``ScenarioError``."""
    if not model.startswith(ENCODED_PREFIX):
        return model
    b64 = model.removeprefix(ENCODED_PREFIX)
    try:
        return base64.b64decode(b64 + "=" * (-len(b64) % 4), altchars=b"-_", validate=True).decode()
    except (binascii.Error, ValueError):
        raise ScenarioError(f"{model!r}: not a base64url-encoded scenario") from None


def parse_scenario(model: str) -> Scenario:
    """Parse a scenario (or a model name standing for one, see ``decode_model``). Raises ``ScenarioError``."""
    model = decode_model(model)
    head, *pairs = model.split(";")
    if head.startswith("transcript:"):
        name = head.removeprefix("transcript:")
        if not _NAME.fullmatch(name) or ".." in name:
            raise ScenarioError(f"transcript name {name!r}: letters, digits, '_', '.', '-' only")
        fields: dict[str, object] = {"kind": "transcript", "transcript": name}
    elif head == "synthetic":
        fields = {"kind": "synthetic"}
    else:
        return Scenario(raw=model, kind="synthetic", model=model)
    for pair in pairs:
        if not pair:
            continue
        key, eq, value = pair.partition("=")
        if not eq:
            raise ScenarioError(f"{pair!r}: expected key=value")
        if key not in KEYS:
            raise ScenarioError(f"unknown scenario key {key!r}; known: {', '.join(KEYS)}")
        if fields["kind"] == "transcript" and key in _GENERATOR_ONLY:
            raise ScenarioError(f"{key} applies only to synthetic scenarios")
        if key != "id":  # id only makes the string unique (times=K counts per exact string)
            fields[key] = _value(key, value)
    return Scenario(raw=model, **fields)  # type: ignore[arg-type]


# -- the synthetic generator ---------------------------------------------------------------------------

_WORDS = (
    "the",
    "stream",
    "of",
    "tokens",
    "arrives",
    "in",
    "order",
    "and",
    "every",
    "event",
    "is",
    "kept",
    "café",
    "naïve",
    "日本語",
    "Привет",
    "river",
    "sluice",
    "gate",
    "water",
    "flows",
    "through",
    "a",
    "narrow",
    "channel",
    "quietly",
    "today",
    "🙂",
    "weather",
    "report",
    "for",
    "Paris",
)
_TOOLS = ("get_weather", "search_docs", "lookup_user", "convert_units")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _text_deltas(sc: Scenario, rng: random.Random) -> list[str]:
    low, high = sc.words
    if sc.text is not None:
        if sc.deltas:  # split the literal into that many pieces
            n = max(1, min(sc.deltas, len(sc.text)))
            step = -(-len(sc.text) // n)
            return [sc.text[i : i + step] for i in range(0, len(sc.text), step)]
        tokens = re.findall(r"\S+\s*|\s+", sc.text)
        out: list[str] = []
        while tokens:
            k = rng.randint(low, high)
            out.append("".join(tokens[:k]))
            del tokens[:k]
        return out
    n = 8 if sc.deltas is None else sc.deltas
    return [("" if i == 0 else " ") + _words(rng, rng.randint(low, high)) for i in range(n)]


def _fragments(rng: random.Random, text: str) -> tuple[str, ...]:
    # Arbitrary substrings: cuts may fall inside keys, values and escape sequences, as real streams do.
    if len(text) < 2:
        return (text,)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 6))))
    return tuple(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True))


def build_script(sc: Scenario, created: int = 1760000000) -> Script:
    """The synthetic stream a scenario describes (``sc.kind == "synthetic"``)."""
    rng = random.Random(sc.seed)
    blocks: list[ScriptBlock] = []
    words = 0
    if sc.reasoning:
        deltas = [("" if i == 0 else " ") + _words(rng, rng.randint(*sc.words)) for i in range(sc.reasoning)]
        words += sum(len(d.split()) for d in deltas)
        blocks.append(Reasoning(tuple(deltas), signature=f"sig_{rng.getrandbits(96):024x}"))
    text = _text_deltas(sc, rng)
    words += sum(len(d.split()) for d in text)
    if sc.stamp:
        text = [STAMP_PLACEHOLDER + d for d in text]
    if text:
        blocks.append(Text(tuple(text)))
    for i in range(sc.tools):
        args = json.dumps(
            {"city": rng.choice(_WORDS), "days": rng.randint(1, 14), "note": 'say "hi"\n', "call": i},
            ensure_ascii=False,
        )
        if sc.bad_tool_json:
            args = args[:-1] + ","  # well framed, but not JSON
        frags = _fragments(rng, args)
        words += len(frags)
        blocks.append(ToolCall(_TOOLS[i % len(_TOOLS)], f"{rng.getrandbits(96):024x}", frags))
    stop: StopKind = sc.stop or ("tool_use" if sc.tools else "stop")
    return Script(
        model=sc.model or "fake-model",
        blocks=tuple(blocks),
        stop=stop,
        input_tokens=rng.randint(10, 60),
        output_tokens=words,
        id=f"{rng.getrandbits(64):016x}",
        created=created,
    )

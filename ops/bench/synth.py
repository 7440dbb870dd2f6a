"""The benchmark's synthetic provider traffic: many realistic responses per dialect, rendered to the exact
bytes that provider sends, and cut into network-like chunks.

Rule: everything is a pure function of (dialect, target size, seed): the same arguments give the same
bytes and the same chunk boundaries, so every measured path (sluice, the floor, the SDKs) is fed exactly
the same input, and two runs compare. A corpus is many whole responses back to back rather than one
giant message: a real stream is a few hundred to a few thousand events, and accumulating one 20 MB
message would measure quadratic string building instead of decoding.

A response is a text block of deltas of 3-8 words (some with punctuation, newlines, quotes and a few
non-ASCII words, which JSON escapes), and in about a third of the responses 1-3 tool calls whose argument
JSON arrives in small fragments cut anywhere (inside keys, values and escapes); usage is reported the way
each provider does; Anthropic streams get the early ``ping`` plus a ping every ~60 events.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from sluice.harness.fake.render import DIALECTS, Script, ScriptBlock, StopKind, Tagged, Text, ToolCall, render_tagged

__all__ = ["Corpus", "SynthStream", "build_corpus", "chunk_body", "make_script", "synth_stream"]

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
    "a",
    "river",
    "gate",
    "water",
    "flows",
    "through",
    "narrow",
    "channel",
    "quietly",
    "today",
    "weather",
    "report",
    "for",
    "Paris",
    "model",
    "answer",
    "question",
    "because",
    "which",
    "would",
    "should",
    "could",
    "data",
    "function",
    "result",
    "value",
    "number",
    "between",
    "after",
    "before",
    "under",
    "over",
    "with",
    "without",
    "we",
    "you",
    "they",
    "it",
    "this",
    "that",
    "these",
    "those",
    "first",
    "second",
    "finally",
    "however",
    "café",
    "naïve",
    "日本語",
    "Привет",
    "🙂",
    "über",
    "señor",
)
_PUNCT = ("", "", "", "", ",", ".", ".", ":", "!", "?", ".\n\n", ' "quoted"', " (aside)", ";")
_TOOLS = ("get_weather", "search_docs", "lookup_user", "convert_units", "run_query")
_PING = b'event: ping\ndata: {"type": "ping"}\n\n'


@dataclass(frozen=True, slots=True)
class SynthStream:
    """One whole response: its script, its rendered body, and the body cut into chunks."""

    script: Script
    body: bytes
    chunks: tuple[bytes, ...]
    sse_events: int  # events with data, as a WHATWG decoder dispatches them (event-stream: frames)
    eventstream: bool = False  # AWS event-stream framing (Bedrock), not text/event-stream

    @property
    def text(self) -> str:
        return "".join(d for b in self.script.blocks if isinstance(b, Text) for d in b.deltas)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(b for b in self.script.blocks if isinstance(b, ToolCall))


@dataclass(frozen=True, slots=True)
class Corpus:
    dialect: str
    seed: int
    streams: tuple[SynthStream, ...]

    @property
    def bytes(self) -> int:
        return sum(len(s.body) for s in self.streams)

    @property
    def sse_events(self) -> int:
        return sum(s.sse_events for s in self.streams)

    @property
    def chunks(self) -> int:
        return sum(len(s.chunks) for s in self.streams)


def _delta(rng: random.Random, first: bool) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 8))]
    text = " ".join(words) + rng.choice(_PUNCT)
    return text if first else " " + text


def _arguments(rng: random.Random, call: int) -> str:
    args = {
        "query": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))),
        "city": rng.choice(("Paris", "Zürich", "東京", "New York", "São Paulo")),
        "days": rng.randint(1, 14),
        "units": rng.choice(("metric", "imperial")),
        "note": 'say "hi"\n\tthen \\ leave',
        "filters": [{"field": rng.choice(_WORDS), "value": rng.random()} for _ in range(rng.randint(0, 4))],
        "call": call,
    }
    return json.dumps(args, ensure_ascii=False)


def _fragments(rng: random.Random, text: str) -> tuple[str, ...]:
    # Token-sized pieces (1-12 characters) cut anywhere, as providers stream argument JSON.
    out: list[str] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i : i + n])
        i += n
    return tuple(out)


def make_script(rng: random.Random, n: int) -> Script:
    """One response: 80-1200 text deltas, and 1-3 fragmented tool calls in about a third of them."""
    deltas = tuple(_delta(rng, i == 0) for i in range(rng.randint(80, 1200)))
    blocks: list[ScriptBlock] = [Text(deltas)]
    if rng.random() < 0.33:
        for call in range(rng.randint(1, 3)):
            name = rng.choice(_TOOLS)
            blocks.append(ToolCall(name, f"{rng.getrandbits(96):024x}", _fragments(rng, _arguments(rng, call))))
    tools = len(blocks) > 1
    stop: StopKind = "tool_use" if tools else ("length" if rng.random() < 0.05 else "stop")
    words = sum(len(d.split()) for d in deltas)
    return Script(
        model="bench-model",
        blocks=tuple(blocks),
        stop=stop,
        input_tokens=rng.randint(20, 4000),
        output_tokens=words + 20 * (len(blocks) - 1),
        id=f"{n:08x}{rng.getrandbits(32):08x}",
    )


def _with_pings(dialect: str, events: list[Tagged], rng: random.Random) -> list[Tagged]:
    if dialect != "anthropic":
        return events  # the other providers send no keep-alive events on a busy stream
    out: list[Tagged] = []
    for tag, data in events:
        out.append((tag, data))
        if tag != "terminal" and rng.random() < 1 / 60:
            out.append(("ping", _PING))
    return out


def chunk_body(body: bytes, rng: random.Random, low: int = 1, high: int = 4096) -> tuple[bytes, ...]:
    """Cut ``body`` into chunks of uniformly random sizes in [low, high] bytes."""
    out: list[bytes] = []
    i = 0
    while i < len(body):
        n = rng.randint(low, high)
        out.append(body[i : i + n])
        i += n
    return tuple(out)


def build_corpus(dialect: str, target_bytes: int, seed: int = 7, *, chunk_sizes: tuple[int, int] = (1, 4096)) -> Corpus:
    """Responses until their bodies add up to at least ``target_bytes``. Raises ``ValueError`` for an
    unknown dialect."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    rng = random.Random(f"{seed}:{dialect}")
    streams: list[SynthStream] = []
    total = 0
    while total < target_bytes or not streams:
        streams.append(synth_stream(dialect, make_script(rng, len(streams)), rng, chunk_sizes))
        total += len(streams[-1].body)
    return Corpus(dialect, seed, tuple(streams))


def synth_stream(
    dialect: str, script: Script, rng: random.Random, chunk_sizes: tuple[int, int] = (1, 4096)
) -> SynthStream:
    """One response of ``script`` as ``dialect`` sends it (with Anthropic's pings), cut into chunks."""
    events = _with_pings(dialect, render_tagged(dialect, script), rng)
    body = b"".join(data for _, data in events)
    framed = dialect == "bedrock-converse"
    return SynthStream(script, body, chunk_body(body, rng, *chunk_sizes), len(events), eventstream=framed)

"""The AI SDK's UI message stream (``?format=ai-sdk``): one request as ``useChat`` consumes it.

Rule: every chunk validates against the ``ai`` package's ``uiMessageChunkSchema`` (v6, and the subset v7
shares): optional fields are omitted, never null; ``input`` is always present; finish reasons come from
its enum; no ``__proto__`` key ever reaches the client (its JSON parser refuses the whole chunk). The
message is the request: ``start`` carries ``messageId`` = the request id, once, at the first attempt.

Mapping, per contract event. Every chunk is one SSE event with an ``id:``: the event's position
``<attempt>-<seq>`` on the last (usually only) chunk it produced, ``<attempt>-<seq>.<k>`` on the k-th of
the ones before, so a disconnect between two chunks of one event still resumes exactly:

- ``stream.start``: ``start`` + ``start-step`` (a later attempt: ``finish-step`` + ``start-step``, and the
  attempt number as ``message-metadata``);
- text / refusal blocks: ``text-start`` / ``text-delta`` / ``text-end`` (a refusal's start carries
  ``providerMetadata.sluice.kind = "refusal"``); reasoning blocks (only those the token lets through):
  ``reasoning-start`` / ``-delta`` / ``-end``; part ids are ``<attempt>:<block id>``;
- tool calls: ``tool-input-start`` (toolCallId = the call id, toolName), ``tool-input-delta`` per
  argument fragment, then at the stop ``tool-input-available`` (``input`` = the parsed arguments) or
  ``tool-input-error`` (arguments missing, marked e.g. ``arguments_error: "truncated"``, holding a key
  the SDK refuses, or (contract 1.3) a verdict that says the call is invalid: an undeclared tool, one the
  tool_choice forbids, arguments that do not match the schema; ``errorText`` says why), with the received
  text as ``input``;
- the final ``stream.done``: ``finish-step`` + ``finish`` (stop→stop, tool_use→tool-calls, length→length,
  content_filter and refusal→content-filter, anything else→other);
- the final ``stream.error``: ``tool-input-error`` for each tool call it left open, ``error`` (errorText
  ``<category>: <message>``), ``finish-step``, ``finish`` (finishReason ``error``);
- signatures, warnings and withheld-block notices: nothing.

A terminal is held until the relay knows whether it is the final one: a later attempt's ``stream.start``
makes it a retried attempt (no ``error`` chunk: ``useChat`` stops reading at the first one; parts it left
open are closed, a tool call with ``tool-input-error``), the end of the request makes it final. sluice's
own facts go in message metadata under ``sluice``: request id, provider, model and attempt at the start;
status, stop reason, provider stop reason, usage, the error's category, the structured answer's verdict
(``answer``) and the final position at the finish. Then ``data: [DONE]``.

Resume: without a position the stream is the whole message from ``start`` (what ``useChat``'s resume
expects: it rebuilds the message from a replay). With ``Last-Event-ID`` or ``?after=`` (a position, or a
chunk id ``<attempt>-<seq>.<k>``) the relay replays the request from its start internally and sends
exactly the chunks after it: no second ``start``, so a client that kept its state continues it. Pure:
frames in, bytes out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from .coalesce import Frame
from .positions import START, Position

__all__ = ["FINISH_REASONS", "HEADERS", "UIMessageStream"]

HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-vercel-ai-ui-message-stream", b"v1"),
    (b"x-accel-buffering", b"no"),
]
FINISH_REASONS = {
    "stop": "stop",
    "tool_use": "tool-calls",
    "length": "length",
    "content_filter": "content-filter",
    "refusal": "content-filter",
}
DONE = b"data: [DONE]\n\n"
HEARTBEAT = b": heartbeat\n\n"
_ENC = msgspec.json.Encoder()


class _BlockV(msgspec.Struct):
    id: str = ""
    index: int = 0
    kind: str = ""
    name: str | None = None
    call_id: str | None = None


class _DeltaV(msgspec.Struct):
    kind: str = ""
    text: str = ""


class _ErrorV(msgspec.Struct):
    category: str = "unknown"
    message: str = ""
    retryable: bool = False
    provider_code: str | None = None
    block_index: int | None = None


class _CheckErrorV(msgspec.Struct):
    pointer: str = ""
    keyword: str = ""
    message: str = ""


class _VerdictV(msgspec.Struct):
    valid: bool = True
    reason: str | None = None
    errors: list[_CheckErrorV] = []
    more_errors: bool = False


def _verdict_text(v: _VerdictV) -> str:
    """The SDK's ``errorText`` for an invalid call: the reason, then where and why, as the verdict lists."""
    errors = "; ".join(f"{e.pointer or '/'}: {e.message}" if e.keyword else e.message for e in v.errors)
    return f"invalid tool call ({v.reason}): {errors}" + ("; …" if v.more_errors else "")


def _verdict_meta(v: _VerdictV) -> dict[str, Any]:
    """A verdict as the contract writes it (defaults left out), for message metadata."""
    if v.valid:
        return {"valid": True}
    doc = {"valid": False, "reason": v.reason, "errors": msgspec.to_builtins(v.errors)}
    return doc | ({"more_errors": True} if v.more_errors else {})


class _EventV(msgspec.Struct):
    """A loose view of a contract event (or a relay notice): unknown fields are ignored, so additions to
    the contract never break this format."""

    type: str = ""
    request_id: str = ""
    provider: str | None = None
    dialect: str | None = None
    model: str | None = None
    attempt: int | None = None
    block: _BlockV | None = None
    delta: _DeltaV | None = None
    arguments: Any = None
    arguments_error: str | None = None
    stop_reason: str | None = None
    provider_stop_reason: str | None = None
    usage: dict[str, Any] | None = None
    status: str | None = None
    error: _ErrorV | None = None
    verdict: _VerdictV | None = None
    answer: _VerdictV | None = None


_DECODER = msgspec.json.Decoder(_EventV)


@dataclass(slots=True)
class _Part:
    kind: str  # text, reasoning, tool
    key: str  # the part id, or the tool call id
    name: str = ""
    refusal: bool = False
    started: bool = False
    closed: bool = False
    raw: list[str] = field(default_factory=list)


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _unsafe(value: Any) -> bool:
    """A key secure-json-parse (the SDK's JSON parser) refuses: ``__proto__``, or ``constructor`` holding
    an object with ``prototype``."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "__proto__" or (k == "constructor" and isinstance(v, dict) and "prototype" in v):
                return True
            if _unsafe(v):
                return True
    elif isinstance(value, list):
        return any(_unsafe(v) for v in value)
    return False


_LAST = 1 << 62  # the index of an event's last chunk, for ordering chunk ids


class UIMessageStream:
    def __init__(self, request_id: str, after: Position = START, after_part: int | None = None) -> None:
        self.request_id = request_id
        self.after = after
        self.after_part = _LAST if after_part is None else after_part
        self._started = False
        self._step_open = False
        self._attempt = 0
        self._parts: dict[tuple[int, int], _Part] = {}
        self._held: tuple[Frame, _EventV] | None = None
        self.finished = False  # the final terminal's chunks were produced

    # -- the relay calls these -----------------------------------------------------------------------

    def push(self, frames: list[Frame], final: Position | None) -> bytes:
        """SSE bytes for ``frames`` (``final``: the final terminal's position once known)."""
        out = bytearray()
        for frame in frames:
            out += self._frame(frame, final)
        return bytes(out)

    def close(self, final: Position | None) -> bytes:
        """At the end of the stream: a held terminal that is the final one, then ``[DONE]``; nothing if
        the request is not over (the client reconnects)."""
        out = bytearray()
        if self._held is not None and final is not None and self._held[0].position == final:
            frame, ev = self._held
            self._held = None
            out += self._emit(frame.position, self._terminal(ev, frame.position))
        if final is not None:
            out += DONE
        return bytes(out)

    # -- mapping -------------------------------------------------------------------------------------

    def _frame(self, frame: Frame, final: Position | None) -> bytes:
        ev = _DECODER.decode(frame.data)
        chunks: list[dict[str, Any]] = []
        if self._held is not None:
            held, _ = self._held
            self._held = None
            if ev.type != "stream.start":  # not a retry after all: nothing can follow a final terminal
                return b""
            chunks += self._abandon(held.position.attempt)
        if ev.type in ("stream.done", "stream.error"):
            if final == frame.position:
                chunks += self._terminal(ev, frame.position)
            else:
                self._held = (frame, ev)
        else:
            chunks += self._event(ev, frame.position)
        return self._emit(frame.position, chunks)

    def _emit(self, position: Position, chunks: list[dict[str, Any]]) -> bytes:
        if not chunks or position < self.after:
            return b""
        out = bytearray()
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            if (position, _LAST if last else k) <= (self.after, self.after_part):
                continue  # the client had it
            cid = str(position) if last else f"{position}.{k}"
            out += b"id: %s\ndata: %s\n\n" % (cid.encode(), _ENC.encode(chunk))
        return bytes(out)

    def _event(self, ev: _EventV, position: Position) -> list[dict[str, Any]]:
        if ev.type == "stream.start":
            return self._start(ev, position.attempt)
        block = ev.block
        if block is None or ev.type not in ("block.start", "block.delta", "block.stop"):
            return []  # stream.warning, block.withheld, anything new
        key = (position.attempt, block.index)
        part = self._parts.get(key)
        if part is None:
            kind = {"tool_call": "tool", "reasoning": "reasoning"}.get(block.kind, "text")
            pid = block.call_id if kind == "tool" and block.call_id else f"{position.attempt}:{block.id}"
            part = self._parts[key] = _Part(kind, pid, block.name or "", refusal=block.kind == "refusal")
        if ev.type == "block.start":
            return self._open(part)
        if ev.type == "block.delta":
            delta = ev.delta
            if delta is None or delta.kind == "signature" or part.closed:
                return []
            chunks = self._open(part)  # its block.start was not seen (trimmed away): open it here
            if part.kind == "tool":
                part.raw.append(delta.text)
                return [*chunks, {"type": "tool-input-delta", "toolCallId": part.key, "inputTextDelta": delta.text}]
            return [*chunks, {"type": f"{part.kind}-delta", "id": part.key, "delta": delta.text}]
        if part.closed:
            return []
        chunks = self._open(part)
        part.closed = True
        if part.kind != "tool":
            return [*chunks, {"type": f"{part.kind}-end", "id": part.key}]
        args = ev.arguments
        if ev.arguments_error is not None or not isinstance(args, dict):
            why = ev.arguments_error or "missing"
            return [*chunks, self._tool_error(part, f"the tool call's arguments are {why}")]
        if _unsafe(args):
            return [*chunks, self._tool_error(part, "the arguments hold a key the AI SDK refuses (__proto__)")]
        if ev.verdict is not None and not ev.verdict.valid:
            return [*chunks, self._tool_error(part, _verdict_text(ev.verdict))]
        return [*chunks, {"type": "tool-input-available", "toolCallId": part.key, "toolName": part.name, "input": args}]

    def _open(self, part: _Part) -> list[dict[str, Any]]:
        if part.started:
            return []
        part.started = True
        if part.kind == "tool":
            return [{"type": "tool-input-start", "toolCallId": part.key, "toolName": part.name}]
        chunk: dict[str, Any] = {"type": f"{part.kind}-start", "id": part.key}
        if part.refusal:
            chunk["providerMetadata"] = {"sluice": {"kind": "refusal"}}
        return [chunk]

    def _tool_error(self, part: _Part, text: str) -> dict[str, Any]:
        part.closed = True
        return {
            "type": "tool-input-error",
            "toolCallId": part.key,
            "toolName": part.name,
            "input": "".join(part.raw),
            "errorText": text,
        }

    def _start(self, ev: _EventV, attempt: int) -> list[dict[str, Any]]:
        self._attempt = attempt
        meta = {
            "sluice": _clean(
                {
                    "request_id": self.request_id,
                    "provider": ev.provider,
                    "model": ev.model,
                    "dialect": ev.dialect,
                    "attempt": attempt,
                }
            )
        }
        if not self._started:
            self._started = self._step_open = True
            return [{"type": "start", "messageId": self.request_id, "messageMetadata": meta}, {"type": "start-step"}]
        chunks: list[dict[str, Any]] = [{"type": "finish-step"}] if self._step_open else []
        self._step_open = True
        return [*chunks, {"type": "start-step"}, {"type": "message-metadata", "messageMetadata": meta}]

    def _abandon(self, attempt: int) -> list[dict[str, Any]]:
        """Close what a retried attempt left open (sluice retries only before any delta: at most a block
        that started empty)."""
        chunks: list[dict[str, Any]] = []
        for (a, _), part in self._parts.items():
            if a != attempt or not part.started or part.closed:
                continue
            if part.kind == "tool":
                chunks.append(self._tool_error(part, f"attempt {attempt} ended before the arguments were complete"))
            else:
                part.closed = True
                chunks.append({"type": f"{part.kind}-end", "id": part.key})
        return chunks

    def _terminal(self, ev: _EventV, position: Position) -> list[dict[str, Any]]:
        self.finished = True
        chunks: list[dict[str, Any]] = []
        meta: dict[str, Any] = {
            "status": ev.status,
            "stop_reason": ev.stop_reason,
            "provider_stop_reason": ev.provider_stop_reason,
            "usage": ev.usage,
            "attempt": position.attempt,
            "position": str(position),
            "answer": _verdict_meta(ev.answer) if ev.answer is not None else None,
        }
        if ev.type == "stream.done":
            for part in self._open_parts(position.attempt):  # never, by the contract; kept valid regardless
                if part.kind != "tool":
                    part.closed = True
                    chunks.append({"type": f"{part.kind}-end", "id": part.key})
                else:
                    chunks.append(self._tool_error(part, "the stream ended before the arguments were complete"))
            reason = FINISH_REASONS.get(ev.stop_reason or "", "other")
        else:
            err = ev.error or _ErrorV()
            for part in self._open_parts(position.attempt):
                if part.kind == "tool":
                    named = err.block_index is not None and self._parts.get((position.attempt, err.block_index)) is part
                    ended = ev.status or "failed"
                    text = err.message if named else f"the stream {ended} before the arguments were complete"
                    chunks.append(self._tool_error(part, text))
            chunks.append({"type": "error", "errorText": f"{err.category}: {err.message}"})
            meta["error"] = _clean(
                {"category": err.category, "retryable": err.retryable, "provider_code": err.provider_code}
            )
            reason = "error"
        if self._step_open:
            chunks.append({"type": "finish-step"})
            self._step_open = False
        chunks.append({"type": "finish", "finishReason": reason, "messageMetadata": {"sluice": _clean(meta)}})
        return chunks

    def _open_parts(self, attempt: int) -> list[_Part]:
        return [p for (a, _), p in self._parts.items() if a == attempt and p.started and not p.closed]

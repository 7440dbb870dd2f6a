"""The stream state machine: turns adapter actions into contract events and enforces the invariants.

Rule: the first event is ``stream.start``; seq goes 1, 2, 3 ...; a content block starts publicly at its
first non-empty content (an empty string never opens a block, in every dialect), a tool call at its
``Open`` (its name and id are content); deltas go only into an open block of a matching kind; a tool
call's argument text is buffered per block and parsed once, at its stop; ``stream.done`` only on the
provider's terminal signal with every block closed; exactly one terminal and nothing after it. On failure
or interruption open blocks are closed internally only: no public ``block.stop`` is faked.

Arguments that are not valid JSON are never repaired. They are a protocol error unless the provider cut
the output: the call's stop is held back until the next decisive action, and only if that is the
terminal with stop reason ``length`` and the call got the stream's last content does it stop with
``arguments: null`` and ``arguments_error: "truncated"`` (the stream then completes). Any other terminal,
or content after it, makes it the protocol error it is.

Output checks (``StreamInfo.checks``, contract 1.3): a tool call whose arguments parsed gets its verdict on
its ``block.stop``; a structured answer gets its verdict on ``stream.done`` when the turn ends with its
answer (stop reason ``stop`` or ``length``). An interrupted or failed stream's answer is never checked.
Under the policy ``fail`` an invalid verdict ends the stream right after it: the tool call's ``block.stop``
(with its verdict), then ``stream.error`` (``invalid_output``, not retryable, naming the block); an invalid
answer's ``stream.error`` carries the verdict in place of ``stream.done``.

Legal moves are the table ``TRANSITIONS``; block-level checks it cannot express live in ``_check_*``.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypedDict, TypeGuard

import msgspec

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, SetUsage, Start, Warn
from sluice.normalizer.assemble import AssembledBlock, Assembly
from sluice.normalizer.checks import Checker
from sluice.schemas.errors import ContractViolation, LimitExceeded, ProviderProtocolError
from sluice.schemas.events import (
    BLOCK_DELTA_KINDS,
    BLOCK_KINDS,
    DELTA_KINDS,
    ERROR_CATEGORIES,
    RETRYABLE_CATEGORIES,
    STOP_REASONS,
    VISIBILITIES,
    Block,
    BlockDelta,
    BlockStart,
    BlockStop,
    Delta,
    ErrorCategory,
    ErrorInfo,
    Event,
    OpenBlock,
    StopReason,
    StreamDone,
    StreamError,
    StreamStart,
    StreamWarning,
    Usage,
    Verdict,
)
from sluice.schemas.result import Result
from sluice.schemas.states import FailedState

__all__ = ["TRANSITIONS", "State", "StreamInfo", "StreamMachine"]

DEFAULT_MAX_TOOL_ARGUMENT_BYTES = 1 << 20


class State(enum.Enum):
    IDLE = "idle"
    STREAMING = "streaming"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    # Members are singletons compared by identity: hashing by identity (in C) is consistent with that,
    # and the table lookup on every event no longer calls Enum.__hash__ in Python.
    __hash__ = object.__hash__


S = State
_TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.INTERRUPTED})

# One entry per legal move; terminal states have none. Fail and interruption are legal from any
# live state and are handled by ``fail``/``interrupt`` (they may have to emit stream.start first).
TRANSITIONS: dict[tuple[State, type], State] = {
    (S.IDLE, Start): S.STREAMING,
    (S.IDLE, Ignore): S.IDLE,
    (S.STREAMING, Open): S.STREAMING,
    (S.STREAMING, Append): S.STREAMING,
    (S.STREAMING, Close): S.STREAMING,
    (S.STREAMING, SetUsage): S.STREAMING,
    (S.STREAMING, Warn): S.STREAMING,
    (S.STREAMING, Ignore): S.STREAMING,
    (S.STREAMING, Finish): S.COMPLETED,
    **{(s, Fail): S.FAILED for s in (S.IDLE, S.STREAMING)},
}


_ARGS_DECODER = msgspec.json.Decoder()
# The stop reasons with which a turn ends in its answer: an answer cut at the token limit is checked too.
_ANSWER_STOPS = frozenset({"stop", "length"})
_ACTION_TYPES = (Start, Open, Append, Close, SetUsage, Finish, Fail, Warn, Ignore)
_VISIBILITIES = (None, *VISIBILITIES)
_ALL_DELTA_KINDS: frozenset[str] = frozenset(DELTA_KINDS)


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What the caller knows before any byte arrives."""

    stream_id: str
    request_id: str
    provider: str
    dialect: str
    attempt: int = 1
    model: str | None = None  # the requested model, until the provider names its own
    route: str = ""  # the configured route the attempt runs on; "" (left out of stream.start): none
    checks: Checker | None = None  # what the output is held to (contract 1.3); None: no verdicts


@dataclass(slots=True)
class _Block:
    ref: Block
    content: AssembledBlock  # what its public events said, as the result folds them
    delta_kinds: frozenset[str]  # BLOCK_DELTA_KINDS of its kind, read on every delta
    args_bytes: int = 0


class _Common(TypedDict):
    """The fields every event of the stream shares (``EventBase``'s)."""

    stream_id: str
    request_id: str
    seq: int
    ts: int
    raw: list[int]


@dataclass(slots=True)
class _Held:
    """A tool call closed with arguments that are not JSON: truncated, or a protocol error."""

    blk: _Block
    raw: list[int]
    error: ProviderProtocolError


def _merge_usage(old: Usage | None, new: Usage) -> Usage:
    if old is None or old == new:
        return new

    def said(v: object) -> bool:
        return v is not None and v is not msgspec.UNSET

    fields = {f: getattr(new, f) if said(getattr(new, f)) else getattr(old, f) for f in Usage.__struct_fields__}
    return Usage(**fields)


class StreamMachine:
    def __init__(self, info: StreamInfo, *, max_tool_argument_bytes: int = DEFAULT_MAX_TOOL_ARGUMENT_BYTES) -> None:
        self.info = info
        self.max_tool_argument_bytes = max_tool_argument_bytes
        self.state = S.IDLE
        self.seq = 0
        self._blocks: list[_Block] = []
        self._fold = Assembly()  # the result: the events this machine emits, folded as ``assemble`` folds them
        # Open blocks by adapter key; an ``Open`` action stands for a content block with no content yet.
        self._open: dict[Hashable, _Block | Open] = {}
        self._held: _Held | None = None
        self._last_content: _Block | None = None  # the block that got the stream's latest content
        self._usage: Usage | None = None
        self.response_id: str | None = None  # the provider's response id, from Start (for telemetry)
        self._unknown: dict[str, int] = {}
        self._notes: list[tuple[str, str]] = []  # request-level warnings, reported before the terminal
        self.ignored = 0
        self.visible_deltas = 0
        self.terminal_event: StreamDone | StreamError | None = None

    # -- public API -------------------------------------------------------------------------------

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL

    @property
    def open_blocks(self) -> int:
        return len(self._open)

    @property
    def unknown_events(self) -> int:
        return sum(self._unknown.values())

    def statistics(self) -> dict[str, int]:
        return {
            "events": self.seq,
            "blocks": len(self._blocks),
            "open_blocks": len(self._open),
            "visible_deltas": self.visible_deltas,
            "ignored_events": self.ignored,
            "unknown_events": self.unknown_events,
        }

    def process(self, action: Action, *, ts: int, raw: list[int] | None = None) -> list[Event]:
        """Apply one adapter action; return the contract events it produces (maybe none).

        Raises ``ProviderProtocolError`` when the provider's sequencing is illegal (delta into a block
        that is not open, terminal with an open block, invalid tool JSON) and ``LimitExceeded`` when a
        tool call's arguments pass their cap; the machine's state is then unchanged, so the caller can
        ``fail`` it. Raises ``ContractViolation`` for an action after the terminal event or one outside
        the contract's vocabularies (a caller or adapter bug).
        """
        if type(action) is Append:  # nearly every action: the short way
            # (STREAMING, Append) stays STREAMING; content for a block that has started, of a kind it takes
            # (so one of the contract's), with no held tool call to judge first: one delta, checked as
            # ``_append`` checks it.
            blk = self._open.get(action.key) if self.state is S.STREAMING else None
            if (
                type(blk) is _Block
                and action.kind in blk.delta_kinds
                and action.text
                and (self._held is None or blk is self._last_content)
            ):
                return [self._delta(blk, action, ts, raw or [])]
            if action.kind in _ALL_DELTA_KINDS:
                nxt = TRANSITIONS.get((self.state, Append))
                if nxt is not None:
                    events = self._append(action, ts, raw or [])
                    self.state = nxt
                    return events
        _check_vocabulary(action)
        if isinstance(action, Fail):
            if action.usage is not None and not self.terminal:
                self._usage = _merge_usage(self._usage, action.usage)
            retryable = action.category in RETRYABLE_CATEGORIES if action.retryable is None else action.retryable
            return self.fail(
                action.category,
                action.message,
                ts=ts,
                raw=raw,
                provider_code=action.provider_code,
                retryable=retryable,
            )
        nxt = TRANSITIONS.get((self.state, type(action)))
        if nxt is None:
            if self.terminal:
                raise ContractViolation(f"{type(action).__name__} after the terminal event ({self.state.value})")
            if self.state is S.IDLE:
                raise ProviderProtocolError(f"{_describe(action)} before the stream started")
            raise ProviderProtocolError(f"{_describe(action)} after the stream started")
        out: list[Event] = []
        refs = raw or []
        if isinstance(action, Append):  # first: nearly every action is one
            out += self._append(action, ts, refs)
        elif isinstance(action, Start):
            self.response_id = action.response_id
            out.append(self._start(action.model, ts, refs))
        elif isinstance(action, Open):
            out += self._open_block(action, ts, refs)
        elif isinstance(action, Close):
            out += self._close_block(action.key, ts, refs)
        elif isinstance(action, SetUsage):
            self._usage = _merge_usage(self._usage, action.usage)
        elif isinstance(action, Warn):
            out.append(self._warning(action.code, action.message, 1, ts, refs))
        elif isinstance(action, Ignore):
            self.ignored += 1
            if action.unknown:
                self._unknown[action.what] = self._unknown.get(action.what, 0) + 1
        elif isinstance(action, Finish):
            out.extend(self._finish(action, ts, refs))
        if self.state not in _TERMINAL:  # an invalid output under the policy "fail" ended the stream already
            self.state = nxt
        return out

    def fail(
        self,
        category: str,
        message: str,
        *,
        ts: int,
        raw: list[int] | None = None,
        provider_code: str | None = None,
        retryable: bool | None = None,
        block_index: int | None = None,
    ) -> list[Event]:
        """End the stream ``failed``: the provider reported an error or the stream broke a protocol."""
        return self._end("failed", category, message, ts, raw, provider_code, retryable, block_index, None)

    def interrupt(
        self, category: str, message: str, *, ts: int, raw: list[int] | None = None, retryable: bool | None = None
    ) -> list[Event]:
        """End the stream ``interrupted``: transport ended, a timer fired, or the request was cancelled
        before the provider's terminal signal, however complete the text looks. ``retryable`` says a
        new attempt may help (e.g. the connection could not even be opened)."""
        return self._end("interrupted", category, message, ts, raw, None, retryable, None, None)

    def result(self) -> Result:
        """The result of the events so far (``assemble`` of them); while the stream runs, with the usage
        seen so far."""
        result = self._fold.result()
        result.usage, result.dialect = self._usage, self.info.dialect
        return result

    # -- moves ------------------------------------------------------------------------------------

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _common(self, ts: int, raw: list[int]) -> _Common:
        return {
            "stream_id": self.info.stream_id,
            "request_id": self.info.request_id,
            "seq": self._next(),
            "ts": ts,
            "raw": list(raw),
        }

    def _start(self, model: str | None, ts: int, raw: list[int]) -> StreamStart:
        i = self.info
        ev = StreamStart(
            **self._common(ts, raw),
            provider=i.provider,
            dialect=i.dialect,
            model=model or i.model,
            attempt=i.attempt,
            route=i.route or msgspec.UNSET,
            checks=i.checks.policy if i.checks is not None else msgspec.UNSET,
        )
        self._fold.apply(ev)
        return ev

    def _open_block(self, a: Open, ts: int, raw: list[int]) -> list[Event]:
        if a.key in self._open:
            held = self._open[a.key]
            index = held.ref.index if isinstance(held, _Block) else None
            raise ProviderProtocolError(f"block {a.key!r} opened twice", block_index=index)
        if a.kind != "tool_call":
            self._open[a.key] = a  # starts publicly at its first non-empty content
            return []
        self._check_held()
        return [self._start_block(a, ts, raw)]

    def _start_block(self, a: Open, ts: int, raw: list[int]) -> BlockStart:
        index = len(self._blocks)
        bid = f"b_{index}"
        call_id, synthesized = a.call_id, False
        if a.kind == "tool_call" and not call_id:
            call_id, synthesized = f"call_{self.info.stream_id}_{index}", True
        visibility = (a.visibility or "internal") if a.kind == "reasoning" else None
        opened = OpenBlock(
            id=bid,
            index=index,
            kind=a.kind,
            name=a.name if a.kind == "tool_call" else None,
            call_id=call_id if a.kind == "tool_call" else None,
            call_id_synthesized=synthesized,
            visibility=visibility,
            encrypted=a.encrypted and a.kind == "reasoning",
        )
        ev = BlockStart(**self._common(ts, raw), block=opened)
        content = self._fold.apply(ev)
        assert content is not None
        blk = _Block(
            ref=Block(id=bid, index=index, kind=a.kind), content=content, delta_kinds=BLOCK_DELTA_KINDS[a.kind]
        )
        self._blocks.append(blk)
        self._open[a.key] = blk
        self._last_content = blk
        return ev

    def _append(self, a: Append, ts: int, raw: list[int]) -> list[Event]:
        blk = self._open.get(a.key)
        if type(blk) is _Block:  # nearly every delta: into a block that has started
            if a.kind not in BLOCK_DELTA_KINDS[blk.ref.kind]:
                raise ProviderProtocolError(f"{a.kind} delta into a {blk.ref.kind} block", block_index=blk.ref.index)
            if not a.text:
                return []
            if self._held is not None and blk is not self._last_content:
                self._check_held()
            return [self._delta(blk, a, ts, raw)]
        if blk is None:
            raise ProviderProtocolError(f"delta for block {a.key!r}, which is not open")
        assert isinstance(blk, Open)
        if a.kind not in BLOCK_DELTA_KINDS[blk.kind]:
            raise ProviderProtocolError(f"{a.kind} delta into a {blk.kind} block")
        if not a.text:
            return []
        self._check_held()
        start = self._start_block(blk, ts, raw)
        started = self._open[a.key]
        assert isinstance(started, _Block)
        return [start, self._delta(started, a, ts, raw)]

    def _delta(self, blk: _Block, a: Append, ts: int, raw: list[int]) -> BlockDelta:
        if a.kind != "signature":
            if blk.ref.kind == "tool_call":
                size = blk.args_bytes + len(a.text.encode())
                if size > self.max_tool_argument_bytes:
                    raise LimitExceeded("tool-call arguments", self.max_tool_argument_bytes, block_index=blk.ref.index)
                blk.args_bytes = size
            self.visible_deltas += 1
        self._last_content = blk
        # Built directly, not through _common: this is the one event every provider event becomes.
        self.seq += 1
        info = self.info
        delta = Delta(kind=a.kind, text=a.text)
        ev = BlockDelta(
            stream_id=info.stream_id,
            request_id=info.request_id,
            seq=self.seq,
            ts=ts,
            raw=list(raw),
            block=blk.ref,
            delta=delta,
        )
        blk.content.add(delta)  # the fold of this event (``Assembly.apply`` of a delta), into its block directly
        return ev

    def _check_held(self) -> None:
        """New content after a tool call whose arguments are not JSON: the call was not cut, it is broken."""
        if self._held is not None:
            raise self._held.error

    def _close_block(self, key: Hashable, ts: int, raw: list[int]) -> list[Event]:
        blk = self._open.get(key)
        if blk is None:
            raise ProviderProtocolError(f"stop for block {key!r}, which is not open")
        if isinstance(blk, Open):
            del self._open[key]  # it never got content: it never started, so it never stops
            return []
        arguments = None
        verdict: Verdict | msgspec.UnsetType = msgspec.UNSET
        if blk.ref.kind == "tool_call":
            try:
                arguments = _parse_arguments(blk.content.text, blk.ref.index)
            except _NotJSON as exc:
                self._check_held()
                del self._open[key]
                self._held = _Held(blk, list(raw), exc)
                return []
            if self.info.checks is not None and self.info.checks.checks_calls:
                verdict = self.info.checks.check_call(blk.content.name or "", arguments)
        del self._open[key]
        ev = BlockStop(**self._common(ts, raw), block=blk.ref, arguments=arguments, verdict=verdict)
        self._fold.apply(ev)
        checks = self.info.checks
        if isinstance(verdict, Verdict) and not verdict.valid and checks is not None and checks.policy == "fail":
            name = blk.content.name or ""
            message = f"tool call {name} (block {blk.ref.index}): {_describe_verdict(verdict)}"
            return [ev, *self._end("failed", "invalid_output", message, ts, raw, None, False, blk.ref.index, None)]
        return [ev]

    def _finish(self, a: Finish, ts: int, raw: list[int]) -> list[Event]:
        if self._open:
            key, first = next(iter(self._open.items()))
            if isinstance(first, Open):
                raise ProviderProtocolError(f"terminal signal while provider block {key!r} is still open")
            raise ProviderProtocolError(
                f"terminal signal while block {first.ref.index} is still open", block_index=first.ref.index
            )
        out: list[Event] = []
        held = self._held
        if held is not None:
            if a.stop_reason != "length" or held.blk is not self._last_content:
                raise held.error
            # The provider says it ran out of tokens, inside this call: it stops without arguments.
            refs = held.raw + [r for r in raw if r not in held.raw]
            cut = BlockStop(**self._common(ts, refs), block=held.blk.ref, arguments=None, arguments_error="truncated")
            self._fold.apply(cut)
            out.append(cut)
            self._held = None
        if a.usage is not None:
            self._usage = _merge_usage(self._usage, a.usage)
        stop: StopReason = a.stop_reason
        if stop == "stop":
            kinds = {b.ref.kind for b in self._blocks}
            if "tool_call" in kinds:
                stop = "tool_use"
            elif "refusal" in kinds:
                stop = "refusal"
        answer: Verdict | msgspec.UnsetType = msgspec.UNSET
        checks = self.info.checks
        if checks is not None and checks.checks_answer and stop in _ANSWER_STOPS:
            answer = checks.check_answer(self._answer_text())
            if not answer.valid and checks.policy == "fail":
                message = f"the answer: {_describe_verdict(answer)}"
                return out + self._end("failed", "invalid_output", message, ts, raw, None, False, None, answer)
        out += self._unknown_warning(ts, raw)
        done = StreamDone(
            **self._common(ts, raw),
            stop_reason=stop,
            provider_stop_reason=a.provider_stop_reason,
            usage=self._usage,
            answer=answer,
        )
        self._fold.apply(done)
        self.terminal_event = done
        out.append(done)
        return out

    def _end(
        self,
        status: FailedState,
        category: str,
        message: str,
        ts: int,
        raw: list[int] | None,
        provider_code: str | None,
        retryable: bool | None,
        block_index: int | None,
        answer: Verdict | None,
    ) -> list[Event]:
        if self.terminal:
            raise ContractViolation(f"a second terminal ({status}) after {self.state.value}")
        if not _is_category(category):
            raise ContractViolation(f"error category {category!r} is not in the contract")
        refs = raw or []
        out: list[Event] = []
        if self.state is S.IDLE:
            out.append(self._start(None, ts, refs))
        out.extend(self._unknown_warning(ts, refs))
        if retryable is None:
            retryable = category in RETRYABLE_CATEGORIES
        err = ErrorInfo(
            category=category,
            retryable=retryable,
            provider_code=provider_code,
            message=message,
            block_index=block_index,
        )
        ev = StreamError(
            **self._common(ts, refs),
            status=status,
            error=err,
            usage=self._usage,
            answer=answer if answer is not None else msgspec.UNSET,
        )
        self._fold.apply(ev)
        out.append(ev)
        self.terminal_event = ev
        # Open blocks are closed internally only: a public block.stop would claim they are whole.
        self._open.clear()
        self._held = None
        self.state = S.FAILED if status == "failed" else S.INTERRUPTED
        return out

    def _answer_text(self) -> str:
        """The final answer: every text block's text, in order (what ``Result.text`` reads)."""
        return "".join(b.content.text for b in self._blocks if b.ref.kind == "text")

    def note(self, code: str, message: str) -> None:
        """A warning about the request rather than an event (e.g. reasoning from another dialect left out
        when the request was built): reported as a ``stream.warning`` just before the terminal."""
        self._notes.append((code, message))

    def _unknown_warning(self, ts: int, raw: list[int]) -> list[Event]:
        out: list[Event] = [self._warning(code, message, 1, ts, raw) for code, message in self._notes]
        self._notes = []
        if not self._unknown:
            return out
        n = self.unknown_events
        kinds = ", ".join(sorted(self._unknown))
        message = f"skipped {n} unknown provider event(s): {kinds}"
        out.append(self._warning("unknown_events_skipped", message, n, ts, raw))
        return out

    def _warning(self, code: str, message: str, count: int, ts: int, raw: list[int]) -> StreamWarning:
        return StreamWarning(**self._common(ts, raw), code=code, message=message, count=count)


class _NotJSON(ProviderProtocolError):
    """Tool-call arguments that are not JSON at all: cut by the provider's token limit, or broken."""


def _parse_arguments(text: str, index: int) -> dict[str, object]:
    if not text.strip():
        return {}  # a tool without arguments streams nothing: that means {}
    try:
        value = _ARGS_DECODER.decode(text)
    except msgspec.DecodeError as exc:
        raise _NotJSON(f"tool-call arguments of block {index} are not valid JSON ({exc})", block_index=index) from None
    except RecursionError:  # msgspec's nesting limit: JSON, but no object a tool could be handed
        raise ProviderProtocolError(
            f"tool-call arguments of block {index} nest deeper than the JSON decoder's limit", block_index=index
        ) from None
    if not isinstance(value, dict):
        raise ProviderProtocolError(
            f"tool-call arguments of block {index} are JSON but not an object", block_index=index
        )
    return value


def _describe_verdict(verdict: Verdict) -> str:
    """One line for an ``invalid_output`` error: the reason and the first error, where it is."""
    first = verdict.errors[0] if verdict.errors else None
    if verdict.reason == "schema":
        where = f" at {first.pointer or '/'} ({first.keyword})" if first is not None else ""
        return f"does not match its schema{where}"
    return first.message if first is not None else f"invalid ({verdict.reason})"


def _is_category(category: str) -> TypeGuard[ErrorCategory]:
    return category in ERROR_CATEGORIES


def _check_vocabulary(action: object) -> None:
    """An action outside the contract's vocabularies would produce an off-contract event: our bug."""
    bad: object = None
    if not isinstance(action, _ACTION_TYPES):
        raise ContractViolation(f"not a machine action: {type(action).__name__}")
    if isinstance(action, Open):
        if action.kind not in BLOCK_KINDS:
            bad = action.kind
        elif action.visibility not in _VISIBILITIES:
            bad = action.visibility
    elif isinstance(action, Append) and action.kind not in _ALL_DELTA_KINDS:
        bad = action.kind
    elif isinstance(action, Finish) and action.stop_reason not in STOP_REASONS:
        bad = action.stop_reason
    elif isinstance(action, Fail) and action.category not in ERROR_CATEGORIES:
        bad = action.category
    if bad is not None:
        raise ContractViolation(f"{_describe(action)} with {bad!r}, which is not in the contract")


def _describe(action: Action) -> str:
    return type(action).__name__.lower()

"""OpenAI Responses streaming (``POST /v1/responses``, ``stream: true``) to contract actions.

Rule: every event repeats its ``type`` and a ``sequence_number`` (0, 1, 2 ...); there is no ``[DONE]``.
Items are keyed by ``output_index`` (the item id only where a server omits the index): servers that
speak this API (GitHub Copilot) give one item a new ``item_id`` on every event, so a changed id is a
``stream.warning`` (``item_id_changed``, once per item), never a new block. A contract block is one
content part (key ``(item, content_index)``: output text, refusal or raw reasoning text), one reasoning
summary part (key ``(item, summary_index)``), a reasoning item's encrypted content (a text-less
``encrypted`` reasoning block) or one function call (the contract's ``call_id`` is the item's
``call_id``, not its ``fc_`` id). Text blocks open on their first non-empty fragment; a function call
opens when ``output_item.added`` announces it with its name and call id.

Items are decoded by type: ``message``, ``reasoning`` and ``function_call`` by their own shape (a
malformed one is a protocol error); any other type (server-side tools such as ``web_search_call`` or
``tool_search_call``, whose ``arguments`` may be an object, and types not known yet) only by its
``type`` and ``id``: kept in the raw log, counted in the ``unknown_events_skipped`` warning, skipped.

A block closes at the first of its ``.done`` events (``output_text.done``, ``refusal.done``,
``content_part.done``, ``reasoning_summary_text.done`` / ``part.done``, ``function_call_arguments.done``,
``output_item.done``, then the terminal response's own ``output``); the later ones are no-ops. A
``.done`` that carries the whole value for a block that streamed nothing (servers that only send
``.done``) supplies it once before the close. A finished item (``output_item.done``, the terminal's
``output``) lists its parts by position, which servers do not always number as their delta events did
(a part streamed as ``content_index`` 1 listed at position 0): a listed part is matched to the item's
streamed block of its kind with the same text, else the one at its position, else the first one no
listed part took, so a part announced and streamed once is one block; only a part left without a
streamed block is supplied whole.

Terminals: ``response.completed`` and ``response.incomplete`` complete the stream, ``response.failed``
and ``error`` fail it; the first one wins (the pipeline ignores what follows, e.g. the
``response.failed`` a real capture sends right after ``error``). ``response.cancelled`` is not a
streaming event (the API documents it only as a webhook for background responses): if a server sends
one it is skipped like a lifecycle event and the EOF that follows makes the stream ``interrupted``.
Annotations, server-side tool progress and repeated lifecycle events are skipped; any other event is
skipped and counted as unknown. ``response.incomplete`` with ``max_output_tokens`` completes with
``length``; a function call it cut stops with ``arguments_error: "truncated"`` (the machine decides). A
``sequence_number`` gap or step back is reported once per anomaly with a ``stream.warning``
(``sequence_gap`` / ``sequence_reordered``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import msgspec

from sluice.normalizer.actions import Action, Append, Close, Fail, Finish, Ignore, Open, Start, Warn
from sluice.normalizer.adapters.base import Adapter, as_str, safe_message
from sluice.normalizer.sse import SSEEvent
from sluice.schemas.errors import ProviderProtocolError
from sluice.schemas.events import BlockKind, DeltaKind, ErrorCategory, StopReason, Usage, Visibility

__all__ = ["OpenAIResponsesAdapter"]


class _InputDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _OutputDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    input_tokens_details: _InputDetails | None = None
    output_tokens_details: _OutputDetails | None = None


class _Part(msgspec.Struct):
    """A content part (output_text, refusal, reasoning_text) or a reasoning summary part."""

    type: str = ""
    text: str | None = None
    refusal: str | None = None


class _ItemHead(msgspec.Struct):
    """What every output item has; all that is read of a type sluice does not translate."""

    id: str | None = None
    type: str = ""


class _Message(_ItemHead):
    content: list[_Part] | None = None


class _FunctionCall(_ItemHead):
    name: str | None = None
    call_id: str | None = None
    arguments: str | None = None


class _Reasoning(_ItemHead):
    summary: list[_Part] | None = None
    content: list[_Part] | None = None
    encrypted_content: str | None = None


_Item = _ItemHead | _Message | _FunctionCall | _Reasoning
_HEAD_DECODER = msgspec.json.Decoder(_ItemHead)
_ITEM_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "message": msgspec.json.Decoder(_Message),
    "function_call": msgspec.json.Decoder(_FunctionCall),
    "reasoning": msgspec.json.Decoder(_Reasoning),
}


def _decode_item(raw: msgspec.Raw) -> _Item:
    """An output item by its type: translated types strictly by their own shape, any other leniently."""
    try:
        head = _HEAD_DECODER.decode(raw)
        decoder = _ITEM_DECODERS.get(head.type)
        return head if decoder is None else decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProviderProtocolError(f"an output item is malformed ({exc})") from None


class _Error(msgspec.Struct):
    code: Any = None
    type: Any = None
    message: Any = None


class _Details(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    id: str | None = None
    model: str | None = None
    status: str | None = None
    output: list[msgspec.Raw] | None = None
    usage: _Usage | None = None
    incomplete_details: _Details | None = None
    error: _Error | None = None


class _Event(msgspec.Struct):
    type: str = ""
    sequence_number: int | None = None
    response: _Response | None = None
    item: msgspec.Raw = msgspec.Raw()  # decoded by type (_decode_item); empty: absent
    item_id: str | None = None
    output_index: int | None = None
    content_index: int | None = None
    summary_index: int | None = None
    part: _Part | None = None
    delta: str | None = None
    text: str | None = None
    refusal: str | None = None
    arguments: str | None = None
    # The `error` event: the SDK puts code/message at the top level, a real capture nests them; a router
    # may report the usage billed beside them.
    code: Any = None
    message: Any = None
    error: _Error | str | None = None
    usage: _Usage | None = None


_DECODER = msgspec.json.Decoder(_Event)

_LIFECYCLE = frozenset({"response.created", "response.in_progress", "response.queued"})
# Documented events sluice deliberately does not translate: annotations (citations of the text already
# streamed), server-side tools OpenAI runs itself (their results reach the model, not the caller), and
# a cancellation that is not a streaming event at all. Anything else unknown is counted and warned about
# (e.g. custom tool calls, shell calls, audio: output a caller would miss).
_SKIPPED = frozenset({"response.output_text.annotation.added", "response.cancelled"})
_SERVER_SIDE_PREFIXES = (
    "response.web_search_call.",
    "response.file_search_call.",
    "response.code_interpreter_call",
    "response.image_generation_call.",
    "response.mcp_call",
    "response.mcp_list_tools.",
)
_TRANSLATED_ITEMS = frozenset({"message", "reasoning", "function_call"})

# Content part type -> (block kind, reasoning visibility). Summaries are written for the user to read;
# raw reasoning text is the model's own.
_PART_KINDS: dict[str, tuple[BlockKind, Visibility | None]] = {
    "output_text": ("text", None),
    "refusal": ("refusal", None),
    "reasoning_text": ("reasoning", "internal"),
}
_SUMMARY: tuple[BlockKind, Visibility] = ("reasoning", "public")

# Which content part type each content event streams into.
_CONTENT_EVENT_PARTS = {
    "response.output_text.delta": "output_text",
    "response.output_text.done": "output_text",
    "response.refusal.delta": "refusal",
    "response.refusal.done": "refusal",
    "response.reasoning_text.delta": "reasoning_text",
    "response.reasoning_text.done": "reasoning_text",
}


def _usage(u: _Usage) -> Usage:
    return Usage(
        input_tokens=u.input_tokens,
        output_tokens=u.output_tokens,
        reasoning_tokens=u.output_tokens_details.reasoning_tokens if u.output_tokens_details else None,
        cache_read_tokens=u.input_tokens_details.cached_tokens if u.input_tokens_details else None,
        total_tokens=u.total_tokens,
    )


def _part_text(part: _Part) -> str | None:
    return part.refusal if part.type == "refusal" else part.text


class OpenAIResponsesAdapter(Adapter):
    dialect = "openai-responses"
    provider = "openai"
    # Keys are the terminal response's status (completed) or its incomplete_details.reason.
    STOP_REASONS: ClassVar[dict[str, StopReason]] = {
        "completed": "stop",
        "max_output_tokens": "length",
        "content_filter": "content_filter",
    }
    # ResponseError.code values (openai-python types/responses/response_error.py), codes seen on the
    # `error` event in the wild, and the error `type`s used when the code is null.
    ERROR_CATEGORIES: ClassVar[dict[str, ErrorCategory]] = {
        "server_error": "server_error",
        "vector_store_timeout": "server_error",
        "server_is_overloaded": "overloaded",
        "service_unavailable_error": "overloaded",
        "rate_limit_exceeded": "rate_limit",
        "insufficient_quota": "billing",
        "invalid_prompt": "invalid_request",
        "context_length_exceeded": "invalid_request",
        "invalid_request_error": "invalid_request",
        "bio_policy": "invalid_request",
        "invalid_image": "invalid_request",
        "invalid_image_format": "invalid_request",
        "invalid_base64_image": "invalid_request",
        "invalid_image_url": "invalid_request",
        "image_too_large": "invalid_request",
        "image_too_small": "invalid_request",
        "image_parse_error": "invalid_request",
        "image_content_policy_violation": "invalid_request",
        "invalid_image_mode": "invalid_request",
        "image_file_too_large": "invalid_request",
        "unsupported_image_media_type": "invalid_request",
        "empty_image_file": "invalid_request",
        "failed_to_download_image": "invalid_request",
        "image_file_not_found": "invalid_request",
        "invalid_api_key": "authentication",
        "authentication_error": "authentication",
        "data_residency_mismatch": "permission",
        "permission_error": "permission",
        "model_not_found": "not_found",
        "not_found_error": "not_found",
    }
    TERMINAL_SIGNALS: ClassVar[dict[str, str]] = {
        "response.completed": "completed (stop; tool_use when the turn made function calls, refusal when it refused)",
        "response.incomplete": "completed (incomplete_details.reason: max_output_tokens -> length, "
        "content_filter -> content_filter)",
        "response.failed": "failed (category from response.error.code)",
        "error": "failed (category from code, top-level or nested under error; error.type if code is null)",
        "EOF before a terminal (there is no [DONE])": "interrupted / transport",
    }

    def __init__(self) -> None:
        self._started = False
        self._last_seq: int | None = None
        self._ids: dict[int, str] = {}  # output_index -> the first item id seen there
        self._indices: dict[str, int] = {}  # item id -> output_index, for events that omit the index
        self._renamed: set[int] = set()  # output indices whose item id changed (warned once)
        self._warnings: list[Warn] = []  # raised while dispatching; emitted before the event's actions
        self._calls: dict[Hashable, _FunctionCall] = {}  # announced function_call items, by item ref
        self._open: dict[Hashable, bool] = {}  # open block key -> has it received text yet?
        self._closed: set[Hashable] = set()
        self._item_keys: dict[Hashable, list[Hashable]] = {}
        self._kinds: dict[Hashable, BlockKind] = {}  # every block key opened, and its kind
        # The text each content or summary block received, to match a finished item's parts to them.
        self._texts: dict[Hashable, list[str]] = {}

    # -- dispatch ---------------------------------------------------------------------------------

    def feed(self, sse: SSEEvent) -> list[Action]:
        ev = _DECODER.decode(sse.data)  # JSON that does not fit: the Normalizer's protocol error
        kind = ev.type or sse.event
        was_started = self._started
        out = self._dispatch(kind, ev)
        warns: list[Action] = []
        seq_warn = self._check_sequence(ev.sequence_number)
        if seq_warn is not None:
            warns.append(seq_warn)
        warns += self._warnings
        self._warnings = []
        if warns:
            # A warning needs a started stream: before this event's actions, or right after its Start.
            if was_started:
                out[:0] = warns
            elif out and isinstance(out[0], Start):
                out[1:1] = warns
        return out

    def _dispatch(self, kind: str, ev: _Event) -> list[Action]:
        if kind in _LIFECYCLE:
            if self._started:
                return [Ignore(kind, unknown=False)]
            self._started = True
            resp = ev.response
            return [Start(model=resp.model if resp else None, response_id=resp.id if resp else None)]
        if kind == "response.output_item.added":
            return self._item_added(ev)
        if kind == "response.output_item.done":
            out: list[Action] = []
            item = _decode_item(ev.item) if ev.item else None
            if item is not None:
                self._settle_item(out, item, self._ref(item.id, ev.output_index))
            return out or [self._skip(kind, item)]
        if kind in ("response.content_part.added", "response.content_part.done"):
            return self._part(kind, ev)
        if kind in ("response.output_text.delta", "response.refusal.delta", "response.reasoning_text.delta"):
            return self._content_delta(kind, ev)
        if kind in ("response.output_text.done", "response.refusal.done", "response.reasoning_text.done"):
            return self._content_done(kind, ev)
        if kind in ("response.reasoning_summary_part.added", "response.reasoning_summary_part.done"):
            return self._summary(kind, ev, ev.part.text if ev.part else None)
        if kind == "response.reasoning_summary_text.delta":
            return self._summary(kind, ev, ev.delta)
        if kind == "response.reasoning_summary_text.done":
            return self._summary(kind, ev, ev.text)
        if kind in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            return self._arguments(kind, ev)
        if kind in ("response.completed", "response.incomplete"):
            return self._finish(kind, ev)
        if kind == "response.failed":
            return self._failed(ev)
        if kind == "error":
            return [self._error_event(ev)]
        if kind in _SKIPPED or kind.startswith(_SERVER_SIDE_PREFIXES):
            return [Ignore(kind, unknown=False)]
        return [Ignore(kind or "untyped event")]

    def _check_sequence(self, seq: int | None) -> Warn | None:
        """One warning per anomaly: a jump forward (events lost) or a number at or below the highest
        seen (reordered or repeated). The first number is not checked: a resumed stream
        (``starting_after``) legitimately starts later than 0."""
        if seq is None:
            return None
        last, self._last_seq = self._last_seq, seq if self._last_seq is None else max(self._last_seq, seq)
        if last is None or seq == last + 1:
            return None
        if seq > last:
            return Warn(
                "sequence_gap",
                f"sequence_number jumped from {last} to {seq}: {seq - last - 1} event(s) missing",
            )
        return Warn("sequence_reordered", f"sequence_number {seq} arrived after {last} (reordered or repeated)")

    # -- items, parts and fragments ---------------------------------------------------------------

    def _ref(self, item_id: str | None, output_index: int | None) -> Hashable:
        """The key of the item an event names: its ``output_index``; its id where the index is missing
        (through the index announced with that id, if any). A second id at one index is reported once."""
        if output_index is None:
            if item_id is None:
                return "output_?"
            return self._indices.get(item_id, item_id)
        if item_id is not None and self._ids.get(output_index) != item_id:
            self._name(output_index, item_id)
        return output_index

    def _name(self, output_index: int, item_id: str) -> None:
        first = self._ids.setdefault(output_index, item_id)
        self._indices.setdefault(item_id, output_index)
        if first != item_id and output_index not in self._renamed:
            self._renamed.add(output_index)
            self._warnings.append(
                Warn(
                    "item_id_changed",
                    f"the item at output_index {output_index} came as {first!r}, now as {item_id!r}; "
                    "items are keyed by output_index",
                )
            )

    @staticmethod
    def _skip(kind: str, item: _Item | None) -> Ignore:
        """An item event that produced nothing. A type sluice does not translate (a server-side tool
        OpenAI ran itself, or one not known yet) is counted: a caller should know output was skipped."""
        if item is None or item.type in _TRANSLATED_ITEMS:
            return Ignore(kind, unknown=False)
        return Ignore(f"{kind}:{item.type or '?'}")

    def _item_added(self, ev: _Event) -> list[Action]:
        if not ev.item:
            return [Ignore("response.output_item.added", unknown=False)]
        item = _decode_item(ev.item)
        ref = self._ref(item.id, ev.output_index)
        out: list[Action] = []
        if isinstance(item, _FunctionCall):
            # The call is announced here with its name and call id; arguments stream afterwards.
            self._calls[ref] = item
            key = ("call", ref)
            if key in self._open or key in self._closed:
                raise ProviderProtocolError(f"function call item {ref!r} announced twice")
            self._open_block(out, key, "tool_call", ref, name=item.name, call_id=item.call_id)
            self._fragment(out, key, "tool_call", "json_text", item.arguments, ref)
        elif isinstance(item, _Message):
            for i, part in enumerate(item.content or []):
                if spec := _PART_KINDS.get(part.type):
                    kind, vis = spec
                    self._fragment(out, ("part", ref, i), kind, "text", _part_text(part), ref, visibility=vis)
        return out or [self._skip("response.output_item.added", item)]

    def _part(self, kind: str, ev: _Event) -> list[Action]:
        part = ev.part or _Part()
        spec = _PART_KINDS.get(part.type)
        if spec is None:
            return [Ignore(f"{kind}:{part.type or '?'}")]
        ref = self._ref(ev.item_id, ev.output_index)
        key = ("part", ref, ev.content_index)
        out: list[Action] = []
        if kind == "response.content_part.added":
            self._fragment(out, key, spec[0], "text", _part_text(part), ref, visibility=spec[1])
        else:
            self._settle(out, key, spec[0], "text", _part_text(part), ref, visibility=spec[1])
        return out or [Ignore(kind, unknown=False)]

    def _content_delta(self, kind: str, ev: _Event) -> list[Action]:
        block, vis = _PART_KINDS[_CONTENT_EVENT_PARTS[kind]]
        ref = self._ref(ev.item_id, ev.output_index)
        out: list[Action] = []
        self._fragment(out, ("part", ref, ev.content_index), block, "text", ev.delta, ref, visibility=vis)
        return out or [Ignore(kind, unknown=False)]

    def _content_done(self, kind: str, ev: _Event) -> list[Action]:
        block, vis = _PART_KINDS[_CONTENT_EVENT_PARTS[kind]]
        ref = self._ref(ev.item_id, ev.output_index)
        full = ev.refusal if kind == "response.refusal.done" else ev.text
        out: list[Action] = []
        self._settle(out, ("part", ref, ev.content_index), block, "text", full, ref, visibility=vis)
        return out or [Ignore(kind, unknown=False)]

    def _summary(self, kind: str, ev: _Event, text: str | None) -> list[Action]:
        ref = self._ref(ev.item_id, ev.output_index)
        key = ("summary", ref, ev.summary_index)
        out: list[Action] = []
        if kind.endswith(".done"):
            self._settle(out, key, _SUMMARY[0], "text", text, ref, visibility=_SUMMARY[1])
        else:
            self._fragment(out, key, _SUMMARY[0], "text", text, ref, visibility=_SUMMARY[1])
        return out or [Ignore(kind, unknown=False)]

    def _arguments(self, kind: str, ev: _Event) -> list[Action]:
        ref = self._ref(ev.item_id, ev.output_index)
        key = ("call", ref)
        if key not in self._open and key not in self._closed:
            # Without output_item.added there is no name and no call id: nothing a caller could run.
            raise ProviderProtocolError(
                f"{kind} for item {ref!r}, which no response.output_item.added announced as a function call"
            )
        out: list[Action] = []
        if kind.endswith(".delta"):
            # Into a block already closed, the Append makes the machine reject the late fragment.
            if ev.delta:
                out.append(Append(key, "json_text", ev.delta))
                if key in self._open:
                    self._open[key] = True
        else:
            self._settle(out, key, "tool_call", "json_text", ev.arguments, ref, always=True)
        return out or [Ignore(kind, unknown=False)]

    def _settle_item(self, out: list[Action], item: _Item, ref: Hashable) -> None:
        """Close every block of a finished item, supplying whole values that were never streamed."""
        if isinstance(item, _Message):
            listed = [
                (i, part, spec) for i, part in enumerate(item.content or []) if (spec := _PART_KINDS.get(part.type))
            ]
            keys = self._listed_keys("part", ref, [(i, spec[0], _part_text(part)) for i, part, spec in listed])
            for i, part, (kind, vis) in listed:
                self._settle(out, keys[i], kind, "text", _part_text(part), ref, visibility=vis)
        elif isinstance(item, _Reasoning):
            summary = list(enumerate(item.summary or []))
            keys = self._listed_keys("summary", ref, [(i, _SUMMARY[0], part.text) for i, part in summary])
            for i, part in summary:
                self._settle(out, keys[i], _SUMMARY[0], "text", part.text, ref, visibility=_SUMMARY[1])
            raw_text = [(i, part) for i, part in enumerate(item.content or []) if part.type == "reasoning_text"]
            keys = self._listed_keys("part", ref, [(i, "reasoning", part.text) for i, part in raw_text])
            for i, part in raw_text:
                self._settle(out, keys[i], "reasoning", "text", part.text, ref, visibility="internal")
            # Opaque reasoning to pass back on the next turn (only with include=reasoning.encrypted_content);
            # it is only final on output_item.done and gets a text-less block of its own.
            self._settle(out, ("encrypted", ref), "reasoning", "signature", item.encrypted_content, ref, encrypted=True)
        elif isinstance(item, _FunctionCall):
            announced = self._calls.get(ref, item)
            self._settle(
                out,
                ("call", ref),
                "tool_call",
                "json_text",
                item.arguments,
                ref,
                always=True,
                name=announced.name or item.name,
                call_id=announced.call_id or item.call_id,
            )
        for key in self._item_keys.get(ref, []):
            if key in self._open:
                self._close(out, key)

    def _listed_keys(
        self, prefix: str, ref: Hashable, listed: list[tuple[int, BlockKind, str | None]]
    ) -> dict[int, Hashable]:
        """The block key of each part a finished item lists (by its position there), matched to the
        blocks this item streamed. Servers number parts differently in their delta events and in the
        done item (the part streamed as ``content_index`` 1 listed at position 0), so a listed part is,
        in this order of preference: the streamed block of its kind whose text is the part's text; the
        streamed block of its kind at its position; the item's first streamed block of its kind that no
        listed part took. A part left over is one never streamed, supplied whole under a key of its own."""
        streamed = [k for k in self._item_keys.get(ref, []) if isinstance(k, tuple) and k[0] == prefix]
        keys: dict[int, Hashable] = {}
        taken: set[Hashable] = set()

        def take(i: int, key: Hashable) -> None:
            keys[i] = key
            taken.add(key)

        for i, kind, text in listed:
            same = [k for k in streamed if k not in taken and self._kinds[k] == kind and self._text(k) == text]
            if text and same:
                own = (prefix, ref, i)
                take(i, own if own in same else same[0])
        for i, kind, _ in listed:
            own = (prefix, ref, i)
            if i not in keys and own not in taken and self._kinds.get(own) == kind:
                take(i, own)
        for i, kind, _ in listed:
            if i not in keys:
                spare = next((k for k in streamed if k not in taken and self._kinds[k] == kind), None)
                own = (prefix, ref, i)
                take(i, spare if spare is not None else own if own not in self._kinds else (prefix, ref, ("listed", i)))
        return keys

    def _text(self, key: Hashable) -> str:
        return "".join(self._texts.get(key, ()))

    def _open_block(
        self,
        out: list[Action],
        key: Hashable,
        kind: BlockKind,
        ref: Hashable,
        *,
        name: str | None = None,
        call_id: str | None = None,
        visibility: Visibility | None = None,
        encrypted: bool = False,
    ) -> None:
        out.append(Open(key, kind, name=name, call_id=call_id, visibility=visibility, encrypted=encrypted))
        self._open[key] = False
        self._kinds[key] = kind
        self._item_keys.setdefault(ref, []).append(key)

    def _close(self, out: list[Action], key: Hashable) -> None:
        out.append(Close(key))
        del self._open[key]
        self._closed.add(key)

    def _fragment(
        self,
        out: list[Action],
        key: Hashable,
        kind: BlockKind,
        delta_kind: DeltaKind,
        text: str | None,
        ref: Hashable,
        **announce: Any,
    ) -> None:
        """A streamed fragment: opens its block on the first non-empty one. A fragment for a block
        already closed goes to the machine anyway, which rejects it as a protocol error."""
        if not text:
            return
        if key not in self._open and key not in self._closed:
            self._open_block(out, key, kind, ref, **announce)
        out.append(Append(key, delta_kind, text))
        if key in self._open:
            self._open[key] = True
            if delta_kind == "text":
                self._texts.setdefault(key, []).append(text)

    def _settle(
        self,
        out: list[Action],
        key: Hashable,
        kind: BlockKind,
        delta_kind: DeltaKind,
        full: str | None,
        ref: Hashable,
        *,
        always: bool = False,
        **announce: Any,
    ) -> None:
        """A ``.done`` for a block: idempotent close. ``full`` is appended only when nothing was
        streamed into the block; an empty value never opens one, except a function call (``always``),
        which is a call even with no arguments."""
        if key in self._closed:
            return
        if key not in self._open:
            if not full and not always:
                return
            self._open_block(out, key, kind, ref, **announce)
        if full and not self._open[key]:
            out.append(Append(key, delta_kind, full))
        self._close(out, key)

    # -- terminals --------------------------------------------------------------------------------

    def _finish(self, kind: str, ev: _Event) -> list[Action]:
        resp = ev.response or _Response()
        out: list[Action] = []
        if not self._started:
            # A server that sends only the terminal response: the stream starts with it.
            self._started = True
            out.append(Start(model=resp.model, response_id=resp.id))
        # The terminal response holds the whole output: items a server never streamed are supplied
        # from it, and a block left open is closed (the response says it is finished).
        for i, raw in enumerate(resp.output or []):
            item = _decode_item(raw)
            self._settle_item(out, item, self._ref(item.id, i))
        for key in list(self._open):
            self._close(out, key)
        if kind == "response.completed":
            reason: str | None = "completed"
        else:
            reason = (resp.incomplete_details.reason if resp.incomplete_details else None) or "incomplete"
        usage = _usage(resp.usage) if resp.usage is not None else None
        out.append(Finish(stop_reason=self.stop_reason(reason), provider_stop_reason=reason, usage=usage))
        return out

    def _failed(self, ev: _Event) -> list[Action]:
        resp = ev.response or _Response()
        err = resp.error or _Error()
        return [self._fail(err.code, err.type, err.message, resp.usage)]

    def _error_event(self, ev: _Event) -> Fail:
        if isinstance(ev.error, _Error):
            e = ev.error
            return self._fail(e.code if e.code is not None else ev.code, e.type, e.message or ev.message, ev.usage)
        return self._fail(ev.code, None, ev.message or ev.error, ev.usage)

    def _fail(self, code: Any, type_: Any, message: Any, usage: _Usage | None) -> Fail:
        """The failure, with the usage the failing event reported (billed all the same), even as the
        stream's first event."""
        provider_code = as_str(code) or as_str(type_)
        return Fail(
            category=self.error_category(provider_code),
            provider_code=provider_code,
            message=safe_message(message, "the provider reported an error"),
            usage=_usage(usage) if usage is not None else None,
        )

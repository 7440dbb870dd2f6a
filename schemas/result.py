"""The assembled result of one stream: what a caller stores or acts on once the stream is terminal.

Rule: a tool call's ``arguments`` is the parsed object only when the stream completed; otherwise it is
``None`` and the received text stays in ``arguments_text``, so nothing half-received can be executed. A
call the provider cut at its token limit has ``arguments_error: "truncated"`` (and no arguments) even in
a completed result. (1.3) A checked tool call carries its ``verdict``; ``tool_calls`` lists only calls
whose verdict is not invalid (``invalid_tool_calls`` the others), and ``as_message`` keeps every parsed call
so each can be answered (an invalid one with an error result). The answer's verdict is ``answer``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from sluice.schemas.events import ArgumentsError, BlockKind, ErrorInfo, StopReason, Usage, Verdict, Visibility
from sluice.schemas.request import Message, Part, ReasoningPart, TextPart, ToolCallPart
from sluice.schemas.states import ResultStatus

__all__ = ["REPLAYABLE_REASONING", "Result", "ResultBlock", "result_hash"]

# Dialects whose reasoning a later request can carry (their requests have a place for it); OpenAI Chat
# Completions has none, so ``as_message`` leaves its reasoning out.
REPLAYABLE_REASONING: frozenset[str] = frozenset({"anthropic", "openai-responses", "gemini", "bedrock-converse"})


class ResultBlock(msgspec.Struct, kw_only=True):
    index: int
    kind: BlockKind
    text: str | None = None
    signature: str | None = None
    name: str | None = None
    call_id: str | None = None
    arguments: dict[str, Any] | None = None
    arguments_text: str | None = None
    # (1.1) as in the contract: why a tool call has no arguments, a reasoning block's visibility, and
    # whether its signature is the provider's encrypted reasoning.
    arguments_error: ArgumentsError | None = None
    visibility: Visibility | None = None
    encrypted: bool = False
    # (1.3) A checked tool call's verdict (its block.stop's); None: not checked.
    verdict: Verdict | None = None


class Result(msgspec.Struct, kw_only=True):
    status: ResultStatus
    stop_reason: StopReason | None = None
    provider_stop_reason: str | None = None
    error: ErrorInfo | None = None
    usage: Usage | None = None
    blocks: list[ResultBlock] = []
    # (1.1) The dialect that produced the stream (from its stream.start): where its reasoning may go back.
    dialect: str | None = None
    # (1.3) The structured answer's verdict (the terminal's); None: no answer was checked.
    answer: Verdict | None = None
    # (1.3) How many tool calls' verdicts are invalid; None: no call was checked.
    invalid_calls: int | None = None

    @property
    def text(self) -> str:
        """The answer's text: every text block, concatenated in order (reasoning and refusals left out)."""
        return "".join(b.text or "" for b in self.blocks if b.kind == "text")

    @property
    def tool_calls(self) -> list[ToolCallPart]:
        """The tool calls a caller may execute, in order: only those with parsed arguments, so none of
        a stream that did not complete and none the provider cut, and none whose verdict is invalid. Each is
        the part the next request's assistant message carries (``signature`` included)."""
        return [self._part(b) for b in self._parsed_calls() if b.verdict is None or b.verdict.valid]

    @property
    def invalid_tool_calls(self) -> list[ToolCallPart]:
        """The parsed tool calls whose verdict is invalid (``verdict`` on each block says why): not to be
        executed, but answered (an error tool result) if the conversation goes on."""
        return [self._part(b) for b in self._parsed_calls() if b.verdict is not None and not b.verdict.valid]

    def _parsed_calls(self) -> list[ResultBlock]:
        return [b for b in self.blocks if b.kind == "tool_call" and b.arguments is not None and b.call_id and b.name]

    @staticmethod
    def _part(b: ResultBlock) -> ToolCallPart:
        assert b.call_id and b.name and b.arguments is not None
        return ToolCallPart(call_id=b.call_id, name=b.name, arguments=b.arguments, signature=b.signature)

    def as_message(self) -> Message:
        """The assistant message that continues the conversation: text (refusals too, as text), the
        reasoning with what its dialect needs to take it back, and the tool calls, in the order the model
        produced them. Only for a completed result; a tool call the provider cut is left out (it cannot
        be executed, so it cannot be answered).

        Raises ``ValueError`` when the result did not complete or holds nothing to send back.
        """
        if self.status != "completed":
            raise ValueError(f"only a completed result continues a conversation (this one is {self.status})")
        parts: list[Part] = []
        pending: list[ResultBlock] = []  # consecutive Responses reasoning blocks: one reasoning item
        for b in self.blocks:
            if b.kind == "reasoning" and self.dialect == "openai-responses":
                pending.append(b)
                if b.encrypted:  # the item's encrypted content comes last, at its output_item.done
                    parts += _responses_item(pending)
                    pending = []
                continue
            parts += _responses_item(pending)
            pending = []
            if b.kind in ("text", "refusal") and b.text:
                sig = b.signature if b.kind == "text" else None
                parts.append(TextPart(text=b.text, signature=sig))
            elif b.kind == "reasoning" and self.dialect in REPLAYABLE_REASONING:
                parts += _reasoning(b, self.dialect)
            elif b.kind == "tool_call" and b.arguments is not None and b.call_id and b.name:
                parts.append(ToolCallPart(call_id=b.call_id, name=b.name, arguments=b.arguments, signature=b.signature))
        parts += _responses_item(pending)
        if not parts:
            raise ValueError("the result holds nothing to send back (no text, reasoning or tool call)")
        return Message(role="assistant", content=parts)


def _reasoning(b: ResultBlock, dialect: str) -> list[Part]:
    if not (b.text or b.signature):
        return []
    if b.encrypted:
        return [ReasoningPart(dialect=dialect, encrypted=b.signature)]
    return [ReasoningPart(dialect=dialect, text=b.text or "", signature=b.signature)]


def _responses_item(blocks: list[ResultBlock]) -> list[Part]:
    """One OpenAI Responses reasoning item from its blocks: summary parts (public), raw reasoning text
    (internal) and the encrypted content (the item's last block, when it was asked for)."""
    if not blocks:
        return []
    summary = [b.text for b in blocks if b.visibility == "public" and b.text]
    text = "".join(b.text or "" for b in blocks if b.visibility == "internal" and not b.encrypted)
    encrypted = next((b.signature for b in blocks if b.encrypted and b.signature), None)
    if not (summary or text or encrypted):
        return []
    return [ReasoningPart(dialect="openai-responses", text=text, summary=summary, encrypted=encrypted)]


# The digest covers what contract 1.0 hashed, plus ``arguments_error`` when set (it says a call was cut) and
# (1.3) the verdicts when set (``verdict``, ``answer``, ``invalid_calls``: what the checks concluded).
# What 1.1 added only to describe blocks (visibility, encrypted: both from block.start) and where the
# result came from (dialect) stays out, so a result hashes as it did under 1.0 and status records
# written before an upgrade still verify.
_UNHASHED_BLOCK_FIELDS = ("visibility", "encrypted")


def result_hash(result: Result) -> str:
    """A stable digest of a result: the audit compares it across re-normalizations."""
    doc = msgspec.to_builtins(result)
    doc.pop("dialect", None)
    if doc.get("usage"):
        doc["usage"].pop("provider_cost", None)  # (1.4) the provider's figure: a 1.3 result keeps its hash
    for name in ("answer", "invalid_calls"):
        if doc.get(name) is None:
            doc.pop(name, None)
    for block in doc["blocks"]:
        for name in _UNHASHED_BLOCK_FIELDS:
            block.pop(name, None)
        for name in ("arguments_error", "verdict"):
            if block.get(name) is None:
                block.pop(name, None)
    return "sha256:" + hashlib.sha256(msgspec.json.encode(doc, order="sorted")).hexdigest()

"""Real provider streams recorded by other projects (``../shared/recorded``, kept outside the repository):
every counted case normalizes, through the same path as ``sluice normalize --dialect D --result``, to
what its ``expect.json`` says.

Conventions (the corpus's README and SOURCES.md): only the fields an expectation lists are compared;
texts exactly; ``one_of`` lists the values a provider convention allows; ``ignore_tool_names`` drops
server-executed tools' blocks on both sides; ``ignore_empty_reasoning`` drops text-less reasoning blocks
(encrypted reasoning kept as a signature); ``scope: vertex-extension`` cases are outside the ``gemini``
dialect and skipped. The corpus is data from public repositories: it is read in place, never copied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from sluice.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
# Beside the checkout (../shared/recorded), or where SLUICE_RECORDED points (a CI clone may live elsewhere).
RECORDED = Path(os.environ.get("SLUICE_RECORDED") or ROOT.parent / "shared" / "recorded")
DIALECTS = {
    "anthropic": "anthropic",
    "openai_chat": "openai-chat",
    "openai_responses": "openai-responses",
    "gemini": "gemini",
}
CASES = sorted(RECORDED.glob("*/*.expect.json")) if RECORDED.is_dir() else []


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.name.removesuffix('.expect.json')}"


def _matches(key: str, want: Any, got: Any) -> bool:
    if isinstance(want, dict) and set(want) == {"one_of"}:
        return got in want["one_of"]
    if key == "call_id" and want is None:
        # The provider sent no call id (Gemini): sluice makes one up, call_<stream_id>_<index>.
        return isinstance(got, str) and got.startswith("call_local:")
    return bool(want == got)


def _diff(want: dict[str, Any], got: dict[str, Any], where: str) -> list[str]:
    return [
        f"{where}.{key}: want {value!r}, got {got.get(key)!r}"
        for key, value in want.items()
        if not _matches(key, value, got.get(key))
    ]


def _blocks(blocks: list[dict[str, Any]], expect: dict[str, Any]) -> list[dict[str, Any]]:
    ignored = set(expect.get("ignore_tool_names", []))
    out = [b for b in blocks if not (b["kind"] == "tool_call" and b.get("name") in ignored)]
    if expect.get("ignore_empty_reasoning"):
        out = [b for b in out if not (b["kind"] == "reasoning" and not b.get("text"))]
    return out


def compare(expect: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """Every difference between an expectation and an assembled result (empty: they agree)."""
    problems = _diff(
        {k: expect[k] for k in ("status", "stop_reason", "provider_stop_reason") if k in expect}, result, ""
    )
    if "error" in expect:
        problems += _diff(expect["error"], result.get("error") or {}, "error")
    if "usage" in expect:
        problems += _diff(expect["usage"], result.get("usage") or {}, "usage")
    want, got = _blocks(expect["blocks"], expect), _blocks(result["blocks"], expect)
    if len(want) != len(got):
        problems.append(
            f"blocks: want {len(want)} ({[b['kind'] for b in want]}), got {len(got)} ({[b['kind'] for b in got]})"
        )
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        problems += _diff(w, g, f"blocks[{i}]")
    return problems


@pytest.mark.skipif(not CASES, reason=f"the recorded corpus is not here ({RECORDED}); nothing to compare")
@pytest.mark.parametrize("path", CASES, ids=_id)
def test_recorded_case_matches_its_expectation(path: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    expect = json.loads(path.read_text())
    if expect.get("scope") == "vertex-extension":
        pytest.skip("Vertex-AI-only stream (partialArgs): outside the gemini dialect, not counted")
    sse = path.with_name(path.name.removesuffix(".expect.json") + ".sse")
    assert main(["normalize", "--dialect", DIALECTS[path.parent.name], "--result", str(sse)]) == 0
    result = json.loads(capsysbinary.readouterr().out)
    assert compare(expect, result) == []

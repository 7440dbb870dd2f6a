"""The ``sluice`` entry point itself: help with examples for every command, modules imported only for the
command that runs, a clean "not available" for a command whose module is missing, and the offline
commands (normalize, frames) through ``main``."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli import main as cli
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import encode_event

ROOT = Path(__file__).resolve().parents[2]
MINE = ("enqueue", "tail", "status", "cancel", "audit", "dlq", "worker", "normalize", "frames")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", MINE)
def test_every_command_has_help_with_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run([name, "--help"], capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"usage: sluice {name}") and "\nexamples:\n  sluice " in out


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["dlq", "list", "--help"], "usage: sluice dlq list"),
        (["dlq", "requeue", "--help"], "usage: sluice dlq requeue"),
    ],
)
def test_dlq_subcommands_have_help(argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(argv, capsys)
    assert code == 0 and out.startswith(usage) and "examples:\n  sluice dlq " in out


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    for name in cli.COMMANDS:
        assert f"\n    {name}" in out, name
    code, _, err = _run([], capsys)
    assert code == 2 and "required: COMMAND" in err


def test_only_the_chosen_command_is_imported() -> None:
    probe = (
        "import sys\nfrom sluice.cli.main import build_parser\nbuild_parser('status').parse_args(['status', 'r'])\n"
        "print(sorted(m for m in ('sluice.cli.audit', 'sluice.cli.dlq', 'sluice.harness.fake.provider', "
        "'sluice.cli.tail_view', 'rich', 'sluice.worker.pipeline.consumer', 'sluice.cli.demo', 'sluice.bench.main') "
        "if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _ghost() -> cli.Loaded:
    module = importlib.import_module("ops.no_such_module")
    return module.configure_parser, module.run_from_args


def _half() -> cli.Loaded:
    from sluice.cli.audit import no_configure, run_from_args  # type: ignore[attr-defined]

    return no_configure, run_from_args


def test_a_command_whose_module_is_missing_is_not_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "ghost", cli.Command(_ghost, "a future command", "sluice ghost"))
    code, out, err = _run(["ghost", "--anything", "x"], capsys)
    assert (code, out) == (2, "")
    assert err == (
        "sluice ghost: not available in this installation (ops.no_such_module cannot be imported: "
        "No module named 'ops.no_such_module')\n"
    )
    code, out, _ = _run(["ghost", "--help"], capsys)
    assert code == 0 and "a future command" in out
    monkeypatch.setitem(cli.COMMANDS, "half", cli.Command(_half, "half a command", "sluice half"))
    code, _, err = _run(["half"], capsys)
    assert code == 2 and err.startswith(
        "sluice half: not available in this installation (sluice.cli.audit cannot be imported: "
        "cannot import name 'no_configure' from 'sluice.cli.audit'"
    )


def test_commands_are_registered_by_reference() -> None:
    """Each loader returns the very functions its module defines (no names looked up by string)."""
    from sluice.cli import requests

    assert cli.COMMANDS["enqueue"].load() == (requests.configure_enqueue, requests.cmd_enqueue)
    assert cli.COMMANDS["normalize"].load() == (cli._configure_normalize, cli._cmd_normalize)
    for name, cmd in cli.COMMANDS.items():
        loaded = cmd.load()
        assert all(callable(f) for f in loaded) and len(loaded) == 2, name


def test_an_unknown_option_prints_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["enqueue", "--routee=x"], capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("usage: sluice enqueue [-h] [--route ROUTE]")
    assert lines[-1] == "sluice enqueue: error: unrecognized arguments: --routee=x"
    code, _, err = _run(["status", "r1", "--nope"], capsys)
    assert code == 2 and err.startswith("usage: sluice status [-h]") and "unrecognized arguments: --nope" in err


def test_normalize_through_main(capsys: pytest.CaptureFixture[str]) -> None:
    body = ROOT / "tests/fixtures/transcripts/anthropic/text_tool_use.sse"
    code, out, err = _run(["normalize", "--dialect", "anthropic", "--request-id", "x", str(body)], capsys)
    assert code == 0 and err == ""
    _, events, result = normalize_bytes([body.read_bytes()], "anthropic", StreamInfo("x:1", "x", "", "anthropic", 1))
    assert out.splitlines() == [encode_event(ev).decode() for ev in events]
    code, out, _ = _run(["normalize", "--dialect", "anthropic", "--result", "--request-id", "x", str(body)], capsys)
    assert json.loads(out)["status"] == result.status == "completed"
    code, out, err = _run(["normalize", "--dialect", "klingon", str(body)], capsys)
    assert code == 2 and out == "" and err.startswith("sluice normalize: unknown dialect 'klingon'")
    code, _, err = _run(["frames", "/no/such/file"], capsys)
    assert code == 2 and err == "sluice frames: no such file: /no/such/file\n"
    code, _, err = _run(["normalize", "--dialect", "anthropic", str(body.parent)], capsys)
    assert code == 2 and err == f"sluice normalize: file {body.parent} is a directory, not a regular file\n"


def test_normalize_skips_a_bedrock_unknown_event_with_a_non_json_payload(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The case found from outside: an event-stream body with ``Records`` (CSV) and ``Stats`` (XML) events."""
    from tests.eventstream_transcripts import encode_frame

    def event(name: str, payload: bytes) -> bytes:
        return encode_frame(
            {":message-type": "event", ":event-type": name, ":content-type": "application/json"}, payload
        )

    body = tmp_path / "body.eventstream"
    body.write_bytes(
        event("messageStart", b'{"role":"assistant"}')
        + event("contentBlockDelta", b'{"contentBlockIndex":0,"delta":{"text":"Hi"}}')
        + event("Records", b"a,b\n1,2\n")
        + event("Stats", b"<Stats><BytesScanned>4</BytesScanned></Stats>")
        + event("contentBlockStop", b'{"contentBlockIndex":0}')
        + event("messageStop", b'{"stopReason":"end_turn"}')
        + event("metadata", b'{"usage":{"inputTokens":1,"outputTokens":1}}')
    )
    code, out, err = _run(["normalize", "--dialect", "bedrock-converse", "--result", str(body)], capsys)
    assert code == 0 and err == ""
    result = json.loads(out)
    assert (result["status"], result["stop_reason"], result["blocks"][0]["text"]) == ("completed", "stop", "Hi")
    code, out, _ = _run(["normalize", "--dialect", "bedrock-converse", str(body)], capsys)
    warnings = [json.loads(x) for x in out.splitlines() if json.loads(x)["type"] == "stream.warning"]
    assert [(w["code"], w["count"]) for w in warnings] == [("unknown_events_skipped", 2)]


def test_frames_through_main(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    body = tmp_path / "b.sse"
    body.write_bytes(b"event: a\ndata: 1\nid: 7\n\n: comment\ndata: x\ndata: y\n\n")
    code, out, _ = _run(["frames", str(body)], capsys)
    assert code == 0
    assert [json.loads(x) for x in out.splitlines()] == [
        {"event": "a", "data": "1", "id": "7", "retry": None},
        {"event": "message", "data": "x\ny", "id": "7", "retry": None},
    ]
